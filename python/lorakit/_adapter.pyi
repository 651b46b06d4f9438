import os
from typing import Any, Mapping, Optional, Tuple, Union

CONVENTIONS: Tuple[str, ...]

class Adapter:
    data: bytes
    config_json: Optional[str]
    format: str
    name: str
    digest: str
    alpha: Optional[float]
    convention: Optional[str]
    def __init__(self, data: Union[bytes, bytearray, memoryview], config_json: Any = ..., format: str = ...,
                 name: str = ..., alpha: Optional[float] = ..., convention: Optional[str] = ...) -> None: ...
    @property
    def label(self) -> str: ...
    def check(self) -> None: ...  # raises LoraError (.key) on a bad key or shape
    @classmethod
    def load(cls, path: Union[str, "os.PathLike[str]"], format: str = ...,
             alpha: Optional[float] = ..., convention: Optional[str] = ...) -> "Adapter": ...
    @classmethod
    def from_state_dict(cls, tensors: Mapping[str, Any], config: Any = ..., format: str = ...,
                        name: str = ..., alpha: Optional[float] = ...,
                        convention: Optional[str] = ...) -> "Adapter": ...
    @classmethod
    def from_peft(cls, peft_model: Any, adapter_name: str = ...,
                  convention: Optional[str] = ...) -> "Adapter": ...
