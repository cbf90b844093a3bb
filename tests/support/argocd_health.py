"""Run the chart's Argo CD health check on a SpeculativePair, in Lua 5.1 as Argo CD does.

Argo CD hands a health script the object as the global ``obj`` (JSON turned
into Lua tables, arrays 1-based) and reads back a table with ``status`` and
``message``. `lupa.lua51` (PyPI) is a real Lua 5.1, the language of Argo CD's
gopher-lua.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lupa.lua51 as lua51

ROOT = Path(__file__).resolve().parents[2]
LUA_PATH = ROOT / "charts" / "specpair-operator" / "health" / "argocd-health.lua"
LUA_SCRIPT = LUA_PATH.read_text()


def _to_lua(runtime: Any, value: object) -> object:
    if isinstance(value, dict):
        return runtime.table_from({k: _to_lua(runtime, v) for k, v in value.items()})
    if isinstance(value, list):
        return runtime.table_from([_to_lua(runtime, v) for v in value])
    return value


def argocd_health(obj: dict[str, Any], probe: str | None = None) -> dict[str, str]:
    """``{"status": ..., "message": ...}`` as Argo CD would show them.

    ``probe`` evaluates a Lua expression in the same runtime instead (e.g.
    ``_VERSION``), returned as the status.
    """
    runtime = lua51.LuaRuntime(unpack_returned_tuples=True)
    runtime.globals().obj = _to_lua(runtime, obj)
    if probe is not None:
        return {"status": str(runtime.eval(probe)), "message": ""}
    result = runtime.execute(LUA_SCRIPT)
    return {"status": str(result["status"]), "message": str(result["message"] or "")}
