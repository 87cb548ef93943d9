"""rope_ext: extend the context window of pretrained Hugging Face models by swapping their position encoding.

The public API: ``patch``, ``unpatch``, ``patched``, ``get_patch``, ``summary``, ``from_pretrained``,
``load_default_model``, ``load_finetune_base``, ``list_methods``, ``list_families``. The extension API (docs/methods.md,
"Extending rope_ext"): ``register_method`` (a method config), ``register_family`` (a family adapter, or a row of
the rotary table), ``register_hook`` (the installer of a new hook kind), ``register_kernel`` (the kernel of a new
attention-term type), ``register_fast_runner`` (a window rule's fast path), each with its ``unregister_*``.
"""

from rope_ext.attention.program import register_kernel, unregister_kernel
from rope_ext.attention.rules import register_fast_runner, unregister_fast_runner
from rope_ext.core import get_patch, patch, patched, summary, unpatch
from rope_ext.families import list_families, register_family, unregister_family
from rope_ext.installers.base import register_hook, unregister_hook
from rope_ext.methods import list_methods, register_method, unregister_method
from rope_ext.runs.models import from_pretrained, load_default_model, load_finetune_base

__version__ = "0.2.0"

__all__ = [
    "from_pretrained",
    "get_patch",
    "list_families",
    "list_methods",
    "load_default_model",
    "load_finetune_base",
    "patch",
    "patched",
    "register_family",
    "register_fast_runner",
    "register_hook",
    "register_kernel",
    "register_method",
    "summary",
    "unpatch",
    "unregister_family",
    "unregister_fast_runner",
    "unregister_hook",
    "unregister_kernel",
    "unregister_method",
]
