"""Generated gRPC/protobuf stubs for the glm5.v1 APIs. DO NOT EDIT: run scripts/gen-protos."""
