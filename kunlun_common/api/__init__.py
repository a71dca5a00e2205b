"""Generated gRPC code for proto/kunlun/v1 (scripts/gen_proto.py)."""
