"""Wire encodings written by hand, with the standard library only: protobuf varints and fields
(`protobuf`), HTTP/2 frames, HPACK literals and gRPC message prefixes (`http2`).

Their users are the paths that skip the libraries: the engine worker's step messages and the frontend's
token deltas, the health probe (which must not import grpcio or protobuf), and the bench's HTTP/2 client.
"""
