"""The services' contracts: protos and the stubs generated from them (`make proto`).

Never edit a ``*_pb2*.py`` by hand; tests/shared/proto checks they match the protos.
"""
