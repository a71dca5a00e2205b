"""gRPC servicers: thin layers that check the caller's role, validate, call, and map errors."""
