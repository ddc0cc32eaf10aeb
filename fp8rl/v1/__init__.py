"""Generated protobuf and gRPC stubs for package fp8rl.v1 (scripts/gen_protos.py; do not edit)."""
