"""Persistence: layer states and metadata to and from one safetensors file, and nothing above that.

- ``atomic``: writes that leave the complete old or the complete new file, never a mix, and the
  sweeping of temporary files that killed writes left;
- ``header``: the file's header read as untrusted bytes (format, version, checksums, offsets);
- ``fileformat``: ``SavedCache`` (states, spec, model config, token ids) <-> the file, with every
  check the file alone allows.

Files are untrusted input. Reading refuses, with a ``CacheFileError`` (a ``ValueError``) naming
the file and the problem, a file that is truncated, has a changed byte, is not a kvcache file (or
of another format version), or whose fields are malformed or disagree with its tensors. What a
file must agree with in a model (its configuration, the layers the spec makes, heads, dtypes) is
checked by ``cachefile.load_cache``, which wraps this package. A forgery that is consistent in
every respect (other key values with recomputed checksums) is a valid file: the checksums catch
accidents, not attackers (there is no signature).

Design: docs/architecture.md, "Persistence".
"""

from .atomic import atomic_write, sweep_temps
from .fileformat import SavedCache, checksum, decode_cache, encode_cache, read_cache_file, write_cache_file
from .header import FORMAT_VERSION, metadata_checksum, one_line, short

__all__ = [
    "FORMAT_VERSION",
    "SavedCache",
    "atomic_write",
    "checksum",
    "decode_cache",
    "encode_cache",
    "metadata_checksum",
    "one_line",
    "read_cache_file",
    "short",
    "sweep_temps",
    "write_cache_file",
]
