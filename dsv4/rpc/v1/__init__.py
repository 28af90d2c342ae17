"""Generated protobuf and gRPC modules of the `dsv4.v1` API.

Do not edit: run `python protos/gen.py` (`make protos`). Sources: protos/dsv4/v1/*.proto.
Only servicers and dsv4.wire touch these classes; everything else uses dsv4.types.
"""
