import os
from typing import Any, Mapping, Optional, Union

class Adapter:
    data: bytes
    config_json: Optional[str]
    format: str
    name: str
    digest: str
    alpha: Optional[float]
    def __init__(self, data: Union[bytes, bytearray, memoryview], config_json: Any = ..., format: str = ...,
                 name: str = ..., alpha: Optional[float] = ...) -> None: ...
    @property
    def label(self) -> str: ...
    @classmethod
    def load(cls, path: Union[str, "os.PathLike[str]"], format: str = ...,
             alpha: Optional[float] = ...) -> "Adapter": ...
    @classmethod
    def from_state_dict(cls, tensors: Mapping[str, Any], config: Any = ..., format: str = ...,
                        name: str = ..., alpha: Optional[float] = ...) -> "Adapter": ...
    @classmethod
    def from_peft(cls, peft_model: Any, adapter_name: str = ...) -> "Adapter": ...
