"""The registry: plugins discovered through entry points (group ``tops``) or registered in-process.

Each entry point is loaded on its own. One that fails to import, declares an incompatible
``TOPS_CORE_API_VERSION`` or registers something malformed is quarantined with its error and
listed by ``tops plugins``; it never stops the others (``TOPS_STRICT_PLUGINS=1`` makes it fatal).

Environment: ``TOPS_DISABLE_PLUGIN_AUTOLOAD=1`` loads no entry points; ``TOPS_PLUGINS=ref,xla``
loads only the named ones (also when autoload is disabled).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import itertools
import threading
import traceback
import warnings
from typing import Any

import pluggy

from tops_core import environment, hookspecs
from tops_core.implementation import Implementation
from tops_core.signatures import SIGNATURES

API_VERSION = 1
"""The plugin API version of this core. A plugin declares the one it was written for as
``TOPS_CORE_API_VERSION``; a different version is incompatible."""

ENTRY_POINT_GROUP = "tops"

_generations = itertools.count()
"""Process-wide, so that no two registry states share a generation (it keys compiled op calls)."""


class PluginError(RuntimeError):
    """A plugin could not be loaded or registered something malformed."""


@dataclasses.dataclass(frozen=True)
class PluginInfo:
    """A loaded plugin; ``implementations`` holds ``(op, qualified name)`` pairs."""

    name: str
    distribution: str | None
    version: str | None
    module: str
    implementations: tuple[tuple[str, str], ...]
    source: str


@dataclasses.dataclass(frozen=True)
class QuarantinedPlugin:
    name: str
    distribution: str | None
    version: str | None
    error: str
    details: str


class _InlinePlugin:
    """Holds implementations registered with ``Registry.register`` under one plugin name."""

    TOPS_CORE_API_VERSION = API_VERSION

    def __init__(self, implementations: tuple[Implementation, ...]):
        self.implementations = implementations

    @hookspecs.hookimpl
    def tops_register_implementations(self, register):
        for implementation in self.implementations:
            register(implementation)


class Registry:
    """Implementations per op, the plugins they came from, and the decision cache."""

    def __init__(self, autoload: bool = True):
        self._manager = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self._manager.add_hookspecs(hookspecs)
        self._implementations: dict[str, dict[str, Implementation]] = {}
        self._plugins: dict[str, PluginInfo] = {}
        self._plugin_objects: dict[str, Any] = {}
        self._quarantined: dict[str, QuarantinedPlugin] = {}
        self._environment_notes: list[str] = []
        self._warned_quarantine: set[str] = set()
        self._autoload_pending = autoload
        self._lock = threading.RLock()
        self.decisions: dict[Any, Any] = {}
        self.generation = next(_generations)

    # -- discovery ---------------------------------------------------------------------------

    def ensure_loaded(self) -> None:
        """Load the entry points now if that has not happened yet (it happens on first use otherwise)."""
        if self._autoload_pending:
            with self._lock:
                if self._autoload_pending:
                    self._autoload_pending = False
                    self.load_entry_points()

    def load_entry_points(self) -> None:
        """Load every plugin of the ``tops`` entry-point group that the environment allows."""
        environment.warn_unknown()
        allow = set(environment.names("TOPS_PLUGINS"))
        disabled = environment.flag("TOPS_DISABLE_PLUGIN_AUTOLOAD")
        entry_points, seen = [], set()
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if (entry_point.name, entry_point.value) not in seen:  # the same distribution visible twice on sys.path
                seen.add((entry_point.name, entry_point.value))
                entry_points.append(entry_point)
        installed = sorted({entry_point.name for entry_point in entry_points})
        self._environment_notes = _environment_notes(allow, disabled, installed)
        if not allow and disabled:
            return
        for entry_point in entry_points:
            if not allow or entry_point.name in allow:
                self._load_entry_point(entry_point)

    def _load_entry_point(self, entry_point: importlib.metadata.EntryPoint) -> None:
        dist = getattr(entry_point, "dist", None)
        distribution = dist.name if dist is not None else None
        version = dist.version if dist is not None else None
        try:
            if entry_point.name in self._plugins:
                raise PluginError(
                    f"plugin name {entry_point.name!r} is already taken by "
                    f"{self._plugins[entry_point.name].distribution or self._plugins[entry_point.name].module}"
                )
            try:
                plugin = entry_point.load()
            except Exception as error:
                raise PluginError(f"import of {entry_point.value} failed: {type(error).__name__}: {error}") from error
            self.register_plugin(plugin, entry_point.name, distribution=distribution, version=version, source="entry point")
        except Exception as error:
            if environment.flag("TOPS_STRICT_PLUGINS"):
                raise
            message = str(error) if isinstance(error, PluginError) else f"{type(error).__name__}: {error}"
            details = "".join(traceback.format_exception(error))
            self._quarantined[entry_point.name] = QuarantinedPlugin(entry_point.name, distribution, version, message, details)

    # -- registration ------------------------------------------------------------------------

    def register_plugin(
        self,
        plugin: Any,
        name: str,
        *,
        distribution: str | None = None,
        version: str | None = None,
        source: str = "in-process",
    ) -> PluginInfo:
        """Register a plugin object; raises PluginError (and registers nothing) when it is malformed."""
        with self._lock:
            if name in self._plugins:
                raise PluginError(f"a plugin named {name!r} is already registered")
            declared = getattr(plugin, "TOPS_CORE_API_VERSION", None)
            if declared is None:
                raise PluginError(f"plugin {name!r} does not declare TOPS_CORE_API_VERSION (this core speaks {API_VERSION})")
            if declared != API_VERSION:
                raise PluginError(f"plugin {name!r} was written for core API version {declared!r}; this core speaks {API_VERSION}")
            try:
                self._manager.register(plugin, name)
                self._manager.check_pending()
            except Exception as error:
                if self._manager.is_registered(plugin):
                    self._manager.unregister(plugin)
                raise PluginError(f"plugin {name!r} has invalid hooks: {error}") from error

            collected: list[Implementation] = []
            try:
                others = [p for p in self._manager.get_plugins() if p is not plugin]
                hook = self._manager.subset_hook_caller("tops_register_implementations", remove_plugins=others)
                hook(register=collected.append)
                implementations = [self._qualify(name, impl) for impl in collected]
                keys = [(impl.op, impl.name) for impl in implementations]
                duplicates = sorted({f"{op}: {impl}" for op, impl in keys if keys.count((op, impl)) > 1})
                if duplicates:
                    raise PluginError(f"plugin {name!r} registered {duplicates} more than once")
            except Exception as error:
                self._manager.unregister(plugin)
                if isinstance(error, PluginError):
                    raise
                raise PluginError(f"plugin {name!r} failed while registering: {type(error).__name__}: {error}") from error

            for impl in implementations:
                self._implementations.setdefault(impl.op, {})[impl.name] = impl
            module = getattr(plugin, "__name__", type(plugin).__module__)
            info = PluginInfo(name, distribution, version, module, tuple(keys), source)
            self._plugins[name] = info
            self._plugin_objects[name] = plugin
            self._quarantined.pop(name, None)
            self._changed()
            return info

    def _changed(self) -> None:
        """Forget cached decisions; a new generation also invalidates compiled op calls."""
        self.decisions.clear()
        self.generation = next(_generations)

    @staticmethod
    def _qualify(plugin: str, impl: Any) -> Implementation:
        if not isinstance(impl, Implementation):
            raise PluginError(f"plugin {plugin!r} registered {impl!r}; expected a tops_core.Implementation")
        if impl.op not in SIGNATURES:
            raise PluginError(f"plugin {plugin!r} registered {impl.name!r} for unknown op {impl.op!r}; known ops: {sorted(SIGNATURES)}")
        signature = SIGNATURES[impl.op]
        qualified = dataclasses.replace(impl, name=f"{plugin}.{impl.name}")
        try:
            qualified.check(signature.features, signature.variable_ndims)
        except (TypeError, ValueError) as error:
            raise PluginError(f"plugin {plugin!r}: {error}") from error
        return qualified

    def register(self, implementation: Implementation, plugin: str = "local") -> Implementation:
        """Register one implementation in-process under ``<plugin>.<name>``; returns it qualified."""
        with self._lock:
            previous = self._plugin_objects.get(plugin)
            if previous is not None and not isinstance(previous, _InlinePlugin):
                raise PluginError(f"plugin {plugin!r} is a loaded plugin; register in-process implementations under another name")
            existing = previous.implementations if previous is not None else ()
            if previous is not None:
                self.unregister_plugin(plugin)
            try:
                self.register_plugin(_InlinePlugin(existing + (implementation,)), plugin)
            except PluginError:
                if previous is not None:
                    self.register_plugin(previous, plugin)
                raise
            return self.get(implementation.op, f"{plugin}.{implementation.name}")

    def unregister_plugin(self, name: str) -> None:
        with self._lock:
            info = self._plugins.pop(name)
            self._manager.unregister(self._plugin_objects.pop(name))
            for op, impl_name in info.implementations:
                del self._implementations[op][impl_name]
            self._changed()

    # -- queries -----------------------------------------------------------------------------

    def implementations(self, op: str) -> list[Implementation]:
        self.ensure_loaded()
        return list(self._implementations.get(op, {}).values())

    def get(self, op: str, name: str) -> Implementation:
        self.ensure_loaded()
        try:
            return self._implementations[op][name]
        except KeyError:
            known = ", ".join(sorted(self._implementations.get(op, {}))) or "none"
            raise ValueError(f"no implementation {name!r} of {op}; registered: {known}") from None

    def all_implementations(self) -> list[Implementation]:
        """Every implementation of every op, ordered by op then name."""
        self.ensure_loaded()
        return [impl for op in sorted(self._implementations) for _, impl in sorted(self._implementations[op].items())]

    def plugins(self) -> list[PluginInfo]:
        self.ensure_loaded()
        return list(self._plugins.values())

    def quarantined(self) -> list[QuarantinedPlugin]:
        self.ensure_loaded()
        return list(self._quarantined.values())

    def environment_notes(self) -> list[str]:
        """What ``TOPS_PLUGINS`` / ``TOPS_DISABLE_PLUGIN_AUTOLOAD`` did to entry-point loading, one line each."""
        self.ensure_loaded()
        return list(self._environment_notes)

    def warn_quarantined(self) -> None:
        """A ``RuntimeWarning`` per quarantined plugin, the first time an op is used after it was quarantined."""
        for plugin in self.quarantined():
            if plugin.name not in self._warned_quarantine:
                self._warned_quarantine.add(plugin.name)
                warnings.warn(
                    f"tops: plugin {plugin.name!r} is quarantined and its implementations are unavailable: "
                    f"{plugin.error} (`tops plugins -v` shows the traceback; TOPS_STRICT_PLUGINS=1 makes this fatal)",
                    RuntimeWarning, stacklevel=4,
                )


def _environment_notes(allow: set[str], disabled: bool, installed: list[str]) -> list[str]:
    notes = []
    if allow:
        skipped = [name for name in installed if name not in allow]
        notes.append(
            f"TOPS_PLUGINS={','.join(sorted(allow))}: only these entry points are loaded"
            + (f"; installed but not loaded: {', '.join(skipped)}" if skipped else "")
        )
        missing = sorted(allow - set(installed))
        if missing:
            notes.append(f"TOPS_PLUGINS names {', '.join(missing)}, which no installed distribution provides (installed: {', '.join(installed) or 'none'})")
        if disabled:
            notes.append("TOPS_DISABLE_PLUGIN_AUTOLOAD=1 is overridden by TOPS_PLUGINS")
    elif disabled:
        notes.append(
            "TOPS_DISABLE_PLUGIN_AUTOLOAD=1: no entry point was loaded"
            + (f"; installed: {', '.join(installed)}" if installed else "")
        )
    return notes


_default: Registry | None = None
_default_lock = threading.Lock()


def default_registry() -> Registry:
    """The process-wide registry, fed by entry points on first use."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Registry()
    return _default


def swap_default_registry(registry: Registry | None) -> Registry | None:
    """Install ``registry`` as the process-wide one and return the previous one (for tests)."""
    global _default
    with _default_lock:
        previous, _default = _default, registry
    return previous
