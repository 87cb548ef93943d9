"""rope_ext: extend the context window of pretrained Hugging Face models by swapping their position encoding."""

from rope_ext.core import get_patch, patch, patched, summary, unpatch
from rope_ext.methods import list_methods
from rope_ext.models import from_pretrained, load_default_model
from rope_ext.families import list_families

__version__ = "0.1.0"

__all__ = [
    "from_pretrained",
    "get_patch",
    "list_families",
    "list_methods",
    "load_default_model",
    "patch",
    "patched",
    "summary",
    "unpatch",
]
