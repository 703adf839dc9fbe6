"""The registry: entry-point discovery, quarantine, allow lists and in-process registration."""

import dataclasses
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

import tops_core
from tests import fakes
from tops_core import PluginError, environment
from tops_core.registry import Registry

GOOD = '''
import dataclasses
import tops_core

TOPS_CORE_API_VERSION = 1

@dataclasses.dataclass(frozen=True)
class Config:
    block: int = 8

def forward(q, k, v, **kwargs):
    return v, None

@tops_core.hookimpl
def tops_register_implementations(register):
    register(tops_core.Implementation(op="simple_gla", name="identity", forward=forward,
             capabilities=tops_core.Capabilities(features={"g_gamma"}), priority={"cpu": 1},
             config=Config(), description="returns v"))
'''
PLUGINS = {
    "goodplugin": ("good", "1.2", GOOD),
    "brokenplugin": ("broken", "0.1", "raise ImportError('libfoo.so: cannot open shared object file')\n"),
    "oldplugin": ("old", "0.3", "TOPS_CORE_API_VERSION = 0\n"),
    "nonsenseplugin": ("nonsense", "0.4", textwrap.dedent('''
        import tops_core
        TOPS_CORE_API_VERSION = 1

        @tops_core.hookimpl
        def tops_register_implementations(register):
            register("not an implementation")
    ''')),
    "wronghookplugin": ("wronghook", "0.5", textwrap.dedent('''
        import tops_core
        TOPS_CORE_API_VERSION = 1

        @tops_core.hookimpl
        def tops_register_kernels(register):
            pass
    ''')),
}


@pytest.fixture
def site(tmp_path, clean_env):
    """Real distributions on disk (dist-info with entry points), put on sys.path."""
    for module, (entry_name, version, source) in PLUGINS.items():
        (tmp_path / module).mkdir()
        (tmp_path / module / "__init__.py").write_text(source)
        info = tmp_path / f"{module}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[tops]\n{entry_name} = {module}\n")
    clean_env.syspath_prepend(str(tmp_path))
    clean_env.setenv("TOPS_PLUGINS", ",".join(entry for entry, _, _ in PLUGINS.values()))
    yield tmp_path
    for module in PLUGINS:
        sys.modules.pop(module, None)


def test_entry_points_load_one_at_a_time_and_bad_ones_are_quarantined(site):
    registry = Registry()
    plugins = {p.name: p for p in registry.plugins()}
    assert set(plugins) == {"good"}
    assert plugins["good"].distribution == "goodplugin" and plugins["good"].version == "1.2"
    assert plugins["good"].implementations == (("simple_gla", "good.identity"),)
    assert [i.name for i in registry.implementations("simple_gla")] == ["good.identity"]
    quarantined = {p.name: p for p in registry.quarantined()}
    assert set(quarantined) == {"broken", "old", "nonsense", "wronghook"}
    assert "ImportError: libfoo.so: cannot open shared object file" in quarantined["broken"].error
    assert "written for core API version 0; this core speaks 1" in quarantined["old"].error
    assert "registered 'not an implementation'; expected a tops_core.Implementation" in quarantined["nonsense"].error
    assert "invalid hooks" in quarantined["wronghook"].error and "tops_register_kernels" in quarantined["wronghook"].error
    assert quarantined["broken"].version == "0.1" and "Traceback" in quarantined["broken"].details


def test_strict_plugins_makes_a_broken_plugin_fatal(site, clean_env):
    clean_env.setenv("TOPS_STRICT_PLUGINS", "1")
    clean_env.setenv("TOPS_PLUGINS", "good,broken")
    with pytest.raises(PluginError, match="import of brokenplugin failed"):
        Registry().plugins()


def test_allow_list_and_disabled_autoload(site, clean_env):
    clean_env.setenv("TOPS_PLUGINS", "good")
    registry = Registry()
    assert [p.name for p in registry.plugins()] == ["good"] and registry.quarantined() == []
    clean_env.delenv("TOPS_PLUGINS")
    clean_env.setenv("TOPS_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert Registry().plugins() == []
    clean_env.setenv("TOPS_PLUGINS", "good")
    assert [p.name for p in Registry().plugins()] == ["good"]


def test_a_misspelt_plugin_variable_is_reported_when_the_plugins_load(site, clean_env):
    clean_env.setattr(environment, "_warned", set())
    clean_env.setenv("TOPS_PLUGIN", "good")
    with pytest.warns(RuntimeWarning, match="unknown environment variable TOPS_PLUGIN is ignored \\(did you mean TOPS_PLUGINS\\?\\)"):
        Registry().plugins()


def test_installed_plugins_are_discovered_through_their_entry_points(clean_env):
    clean_env.setenv("TOPS_PLUGINS", "ref,xla,tpu_pallas")
    plugins = {p.name: p for p in Registry().plugins()}
    assert {"ref", "xla", "tpu_pallas"} <= set(plugins)
    assert plugins["xla"].distribution == "tops-plugins-xla" and plugins["xla"].source == "entry point"


def _run(code, site, **env):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TOPS_")}
    environment |= {"PYTHONPATH": str(site), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120)


def test_a_broken_plugin_stops_neither_import_nor_the_cli(site):
    allow = {"TOPS_PLUGINS": "good,broken"}
    result = _run("import tops_core; print(len(tops_core.default_registry().quarantined()))", site, **allow)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"
    result = _run("import sys; from tops_core.cli import main; sys.exit(main(['plugins']))", site, **allow)
    assert result.returncode == 1, "tops plugins exits non-zero while a plugin is quarantined"
    assert "goodplugin" in result.stdout and "good.identity (simple_gla)" in result.stdout
    assert "quarantined (1):" in result.stdout and "broken (brokenplugin 0.1): import of brokenplugin failed" in result.stdout


def test_strict_plugins_fails_at_import_not_at_the_first_call(site):
    result = _run("import tops_core", site, TOPS_PLUGINS="good,broken", TOPS_STRICT_PLUGINS="1")
    assert result.returncode != 0
    assert "PluginError: import of brokenplugin failed" in result.stderr
    assert _run("import tops_core", site, TOPS_PLUGINS="good", TOPS_STRICT_PLUGINS="1").returncode == 0


def test_using_an_op_warns_once_about_each_quarantined_plugin(site, clean_env):
    from tops_core import registry as registry_module

    clean_env.setenv("TOPS_PLUGINS", "good,broken")
    previous = registry_module.swap_default_registry(Registry())
    try:
        q, k, v, _, g_gamma = fakes.inputs()
        with pytest.warns(RuntimeWarning, match="plugin 'broken' is quarantined .*import of brokenplugin failed"):
            tops_core.op("simple_gla").forward(q, k, v, g_gamma=g_gamma)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tops_core.op("simple_gla").forward(q, k, v, g_gamma=g_gamma + 0.1)
    finally:
        registry_module.swap_default_registry(previous)


def test_the_environment_explains_what_it_did_to_loading(site, clean_env):
    clean_env.setenv("TOPS_PLUGINS", "good,nosuch")
    notes = Registry().environment_notes()
    assert any(note.startswith("TOPS_PLUGINS=good,nosuch: only these entry points are loaded; installed but not loaded: ") for note in notes)
    assert any("TOPS_PLUGINS names nosuch, which no installed distribution provides" in note for note in notes)
    clean_env.delenv("TOPS_PLUGINS")
    clean_env.setenv("TOPS_DISABLE_PLUGIN_AUTOLOAD", "1")
    (note,) = Registry().environment_notes()
    assert note.startswith("TOPS_DISABLE_PLUGIN_AUTOLOAD=1: no entry point was loaded; installed: ") and "good" in note


@pytest.mark.parametrize("name", ["TOPS_DISABLE_PLUGIN_AUTOLOAD", "TOPS_STRICT_PLUGINS"])
def test_flag_values_must_be_booleans(site, clean_env, name):
    clean_env.setenv(name, "2")
    with pytest.raises(ValueError, match=f"{name}='2' is not a boolean"):
        Registry().plugins()


@pytest.mark.parametrize("plugin, message", [
    (object(), "does not declare TOPS_CORE_API_VERSION"),
    (type("Future", (), {"TOPS_CORE_API_VERSION": 2}), "written for core API version 2"),
])
def test_in_process_plugins_are_checked_like_entry_points(registry, plugin, message):
    with pytest.raises(PluginError, match=message):
        tops_core.register_plugin(plugin, "mine")
    assert registry.plugins() == []


class MyKernels:
    TOPS_CORE_API_VERSION = 1

    @tops_core.hookimpl
    def tops_register_implementations(self, register):
        register(fakes.implementation("scan"))
        register(fakes.implementation("twice"))


def test_in_process_plugin_object_registers_and_unregisters(registry):
    info = tops_core.register_plugin(MyKernels(), "mine")
    assert info.implementations == (("simple_gla", "mine.scan"), ("simple_gla", "mine.twice"))
    assert info.source == "in-process"
    with pytest.raises(PluginError, match="already registered"):
        tops_core.register_plugin(MyKernels(), "mine")
    tops_core.unregister_plugin("mine")
    assert registry.implementations("simple_gla") == []


@pytest.mark.parametrize("implementation, message", [
    (fakes.implementation("Bad-Name"), "implementation name must match"),
    (fakes.implementation(forward="nope"), "forward must be callable"),
    (fakes.implementation(features={"alibi"}), "unknown features ['alibi']"),
    (fakes.implementation(ndims={"g": {1}}), "ndims declared for ['g']"),
    (fakes.implementation(priority={"cuda": 1}), "priority entries must be platform -> int"),
    (fakes.implementation(priority=[1]), "priority must be a mapping"),
    (dataclasses.replace(fakes.implementation(), config_sweep=({"block": 2},)), "config has no field(s) ['block']"),
    (dataclasses.replace(fakes.implementation(), explain_config="chunk 64"), "explain_config must be a callable"),
    (dataclasses.replace(fakes.implementation(), config=None, explain_config=lambda config, spec, direction: ""), "needs a config to explain"),
])
def test_malformed_implementations_are_refused_with_the_reason(registry, implementation, message):
    with pytest.raises(PluginError) as raised:
        tops_core.register(implementation)
    assert message in str(raised.value)
    assert registry.implementations("simple_gla") == []


def test_unknown_op_and_duplicates_are_refused(registry):
    with pytest.raises(PluginError, match="unknown op 'softmax'"):
        tops_core.register(dataclasses.replace(fakes.implementation(), op="softmax"))

    class Twice:
        TOPS_CORE_API_VERSION = 1

        @tops_core.hookimpl
        def tops_register_implementations(self, register):
            register(fakes.implementation("same"))
            register(fakes.implementation("same"))

    with pytest.raises(PluginError, match=r"registered \['simple_gla: twice.same'\] more than once"):
        tops_core.register_plugin(Twice(), "twice")


def test_register_adds_to_an_in_process_plugin_and_keeps_it_on_failure(registry):
    fakes.register("first", plugin="mine")
    fakes.register("second", plugin="mine")
    with pytest.raises(PluginError):
        tops_core.register(fakes.implementation("BAD"), plugin="mine")
    assert sorted(i.name for i in registry.implementations("simple_gla")) == ["mine.first", "mine.second"]


def test_a_plugin_that_raises_while_registering_is_refused(registry):
    class Raises:
        TOPS_CORE_API_VERSION = 1

        @tops_core.hookimpl
        def tops_register_implementations(self, register):
            register(fakes.implementation("partial"))
            raise RuntimeError("CUDA driver not found")

    with pytest.raises(PluginError, match="failed while registering: RuntimeError: CUDA driver not found"):
        tops_core.register_plugin(Raises(), "raises")
    assert registry.implementations("simple_gla") == [] and registry.plugins() == []
