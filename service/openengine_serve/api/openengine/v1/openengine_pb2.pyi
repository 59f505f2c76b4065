from openengine_serve.api.openengine.v1 import generation_pb2 as _generation_pb2
from openengine_serve.api.openengine.v1 import kv_pb2 as _kv_pb2
from openengine_serve.api.openengine.v1 import lifecycle_pb2 as _lifecycle_pb2
from openengine_serve.api.openengine.v1 import lora_pb2 as _lora_pb2
from openengine_serve.api.openengine.v1 import model_pb2 as _model_pb2
from openengine_serve.api.openengine.v1 import server_pb2 as _server_pb2
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor
