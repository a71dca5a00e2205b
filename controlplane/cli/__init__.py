"""`kunlun-cli`, the operator's tool."""
