"""Family adapters (installed as ``rope_ext.families``): locators of each architecture's position sites.

Families that differ only by their rotary class are rows of the table in ``rotary.py``, or rows found from
transformers' own modeling packages (``discovered.py``); a family with behaviour of its own is a module here that
calls ``register_family``, plus one import line below.
"""

from rope_ext.families import deberta, gpt2, opt, rotary, t5, xlnet  # noqa: F401  (registers the families)
from rope_ext.families.base import (
    CONFIG_KEY,
    DISCOVERERS,
    FamilyAdapter,
    find_family,
    get_family,
    list_families,
    register_family,
    unregister_family,
)
from rope_ext.families.discovered import discover, discover_all
from rope_ext.families.listing import (
    TABLE_END,
    TABLE_START,
    listing,
    support_summary,
    support_table,
    supports,
    with_support_table,
)
from rope_ext.families.support import Refusals, Support

DISCOVERERS.append(discover)

__all__ = [
    "CONFIG_KEY",
    "TABLE_END",
    "TABLE_START",
    "FamilyAdapter",
    "Refusals",
    "Support",
    "discover_all",
    "find_family",
    "get_family",
    "list_families",
    "listing",
    "register_family",
    "support_summary",
    "support_table",
    "supports",
    "unregister_family",
    "with_support_table",
]
