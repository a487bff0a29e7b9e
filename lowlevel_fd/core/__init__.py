"""The layer every kernel family stands on: the support matrix, argument checks, the cache
description (KVCacheSpec), the cache binder and the kernel loader. Families (decode, append)
meet here and never import each other."""
from .spec import KVCacheSpec

__all__ = ["KVCacheSpec"]
