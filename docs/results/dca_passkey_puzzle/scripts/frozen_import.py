"""Import rope_ext from the frozen worktree /tmp/dca_puzzle, *including* rope_ext.patches: the editable install
maps rope_ext.patches to the live /work/main/patches (pyproject package-dir), which is being refactored."""
import importlib.util
import sys

FROZEN = "/tmp/dca_puzzle"


class _FrozenPatches:
    def find_spec(self, name, path=None, target=None):
        if name == "rope_ext.patches":
            return importlib.util.spec_from_file_location(
                name, f"{FROZEN}/patches/__init__.py", submodule_search_locations=[f"{FROZEN}/patches"])
        return None


sys.meta_path.insert(0, _FrozenPatches())
if FROZEN not in sys.path:
    sys.path.insert(0, FROZEN)
import rope_ext  # noqa: E402
import rope_ext.patches  # noqa: E402

assert rope_ext.__file__.startswith(FROZEN + "/"), rope_ext.__file__
assert rope_ext.patches.__file__.startswith(FROZEN + "/"), rope_ext.patches.__file__
