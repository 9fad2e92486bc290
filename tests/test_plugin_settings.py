"""The plugin's settings take only their documented values: every switch the same spellings, anything else
stops the start with one line naming the variable and what it takes; ``moeplace launch`` checks the same
settings, with the same function, before it starts SGLang."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeplace.cli import main
from moeplace.files.placement import Placement, save_placement
from moeplace.model.spec import ModelSpec
from moeplace.sglang import settings
from moeplace.sglang.settings import SWITCH_OFF, SWITCH_ON, SWITCHES, SettingError, check_settings

BAD_SWITCH_VALUES = ["2", "enable", "enabled", "y", "n", "-1", "1.0", "truee", "ON!"]


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("value", BAD_SWITCH_VALUES)
def test_a_switch_takes_only_its_spellings(name: str, value: str) -> None:
    with pytest.raises(SettingError) as e:
        check_settings({name: value})
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{name}={value!r}") and "1, true, yes, on" in line


@pytest.mark.parametrize("name", SWITCHES)
def test_every_switch_reads_every_spelling_alike(name: str) -> None:
    field = {"MOEPLACE_TRACE": "trace", "MOEPLACE_KV_SORT": "kv_sort", "MOEPLACE_VERIFY_KERNEL": "verify_kernel",
             "MOEPLACE_ONLINE": "online"}[name]
    for value in SWITCH_ON:
        for shown in (value, value.upper(), f" {value} "):
            assert getattr(check_settings({name: shown, "MOEPLACE_TRACE_DIR": ""}), field) is True
    for value in SWITCH_OFF:
        assert getattr(check_settings({name: value}), field) is False


def test_the_verify_kernel_reads_its_switch_as_the_plugin_does(monkeypatch) -> None:
    from moeplace.sglang.verify_backend import enabled

    monkeypatch.setenv("MOEPLACE_VERIFY_KERNEL", "true")
    assert enabled() and check_settings().verify_kernel


@pytest.mark.parametrize("env, named", [
    ({"MOEPLACE_DISPATCH": "balance"}, "MOEPLACE_DISPATCH"),
    ({"MOEPLACE_DISPATCH": "1"}, "MOEPLACE_DISPATCH"),
    ({"MOEPLACE_DISPATCH": "cost", "MOEPLACE_DISPATCH_Q": "abc"}, "MOEPLACE_DISPATCH_Q"),
    ({"MOEPLACE_DISPATCH": "cost", "MOEPLACE_DISPATCH_WEIGHTS": "1,2"}, "MOEPLACE_DISPATCH_WEIGHTS"),
    ({"MOEPLACE_DISPATCH_Q": "4"}, "MOEPLACE_DISPATCH_Q"),     # set, but the rule that reads it is off
    ({"MOEPLACE_DISPATCH": "balanced", "MOEPLACE_DISPATCH_MAX_TOKENS": "many"}, "MOEPLACE_DISPATCH_MAX_TOKENS"),
    ({"MOEPLACE_DISPATCH": "balanced", "MOEPLACE_DISPATCH_MAX_TOKENS": "1" + "0" * 29}, "up to 8,192"),
    ({"MOEPLACE_DISPATCH": "cost", "MOEPLACE_DISPATCH_Q": "4", "MOEPLACE_DISPATCH_MAX_TOKENS": "8193"}, "up to 8,192"),
    ({"MOEPLACE_TRACE": "1", "MOEPLACE_TRACE_SLOTS": "1e40"}, "MOEPLACE_TRACE_SLOTS"),
    ({"MOEPLACE_TRACE_DIR": "/tmp/t", "MOEPLACE_TRACE_FLUSH_SECONDS": "1e300"}, "MOEPLACE_TRACE_FLUSH_SECONDS"),
    ({"MOEPLACE_ONLINE": "1", "MOEPLACE_ONLINE_WINDOW": "0"}, "MOEPLACE_ONLINE_WINDOW"),
    ({"MOEPLACE_ONLINE": "1", "MOEPLACE_ONLINE_PERIOD": "1.5"}, "MOEPLACE_ONLINE_PERIOD"),
    ({"MOEPLACE_ONLINE": "1", "MOEPLACE_ONLINE_MIN_GAIN": "1"}, "MOEPLACE_ONLINE_MIN_GAIN"),
    ({"MOEPLACE_ONLINE": "1", "MOEPLACE_ONLINE_MOVE_GBPS": "inf"}, "MOEPLACE_ONLINE_MOVE_GBPS"),
    ({"MOEPLACE_ONLINE": "1", "MOEPLACE_ONLINE_HORIZON": "-3"}, "MOEPLACE_ONLINE_HORIZON"),
    ({"MOEPLACE_ONLINE": "1", "MOEPLACE_TRACE_SLOTS": "0"}, "MOEPLACE_TRACE_SLOTS"),   # the tracer keeps the window
    ({"MOEPLACE_ONLINE_WINDOW": "500"}, "MOEPLACE_ONLINE_WINDOW"),   # set, but online re-placement is off
])
def test_other_settings_are_checked_too(env: dict[str, str], named: str) -> None:
    with pytest.raises(SettingError, match=named):
        check_settings(env)


def test_the_dispatch_batch_limit_takes_every_batch_the_kernel_can() -> None:
    from moeplace.sglang.balanced_dispatch import DispatchConfig

    config = DispatchConfig.from_env({"MOEPLACE_DISPATCH": "balanced", "MOEPLACE_DISPATCH_MAX_TOKENS": "8192"})
    assert config.max_tokens == 8192   # 8192 rows of top-1: the kernel's 8192 ids


@pytest.mark.parametrize("variable, switch", [("MOEPLACE_TRACE_DIR", "MOEPLACE_TRACE"),
                                              ("MOEPLACE_ONLINE_DIR", "MOEPLACE_ONLINE")])
def test_a_folder_the_plugin_cannot_write_stops_the_start(tmp_path, variable, switch) -> None:
    afile = tmp_path / "afile"
    afile.write_text("kept\n")
    for folder, why in ((afile, f"{afile} is a file, not a folder"),
                        (afile / "traces", f"{afile} is a file, not a folder"),
                        ("/proc/moeplace-traces", "cannot write in /proc")):
        with pytest.raises(SettingError) as e:
            check_settings({switch: "1", variable: str(folder)})
        assert str(e.value).startswith(f"{variable}={str(folder)!r}: {why}")
    assert afile.read_text() == "kept\n" and [p.name for p in tmp_path.iterdir()] == ["afile"]


def test_a_trace_dir_that_can_be_made_or_written_is_taken_and_nothing_is_left(tmp_path) -> None:
    (tmp_path / "there").mkdir()
    for folder in (tmp_path / "there", tmp_path / "new" / "deeper"):
        assert check_settings({"MOEPLACE_TRACE_DIR": str(folder)}).trace
    assert [p.name for p in tmp_path.iterdir()] == ["there"] and not list((tmp_path / "there").iterdir())


def test_the_plugin_stops_with_one_line(monkeypatch, capsys) -> None:
    from moeplace.sglang.plugin import enabled_features

    monkeypatch.setenv("MOEPLACE_KV_SORT", "2")
    with pytest.raises(SystemExit) as e:
        enabled_features()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "MOEPLACE_KV_SORT='2'" in err


def test_settings_import_nothing_heavy() -> None:
    assert "torch" not in settings.__dict__ and "sglang" not in settings.__dict__


TOY_CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 4,
              "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 16, "num_experts_per_tok": 4}


@pytest.mark.parametrize("env, named", [
    ({"MOEPLACE_DISPATCH_Q": "abc"}, "MOEPLACE_DISPATCH_Q"),
    ({"MOEPLACE_DISPATCH": "cost", "MOEPLACE_DISPATCH_WEIGHTS": "1,2"}, "MOEPLACE_DISPATCH_WEIGHTS"),
    ({"MOEPLACE_TRACE": "enable"}, "MOEPLACE_TRACE"),
    ({"MOEPLACE_TRACE": "1", "MOEPLACE_TRACE_DIR": "/proc/moeplace-traces"}, "MOEPLACE_TRACE_DIR='/proc/moeplace-traces'"),
    ({"MOEPLACE_TRACE_DIR": "/proc/self/status"}, "is a file, not a folder"),
    ({"MOEPLACE_DISPATCH": "balanced", "MOEPLACE_DISPATCH_MAX_TOKENS": "1" + "0" * 29}, "MOEPLACE_DISPATCH_MAX_TOKENS"),
])
def test_launch_checks_the_plugin_settings_before_sglang(tmp_path, monkeypatch, capsys, env, named) -> None:
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "config.json").write_text(json.dumps(TOY_CONFIG))
    save_placement(tmp_path / "p.json", Placement(ModelSpec("toy", 4, (1, 2, 3), 16, 4), 4, np.tile(np.arange(16), (3, 1))))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        main(["launch", "--placement", str(tmp_path / "p.json"), "--dry-run", "--", "--model-path",
              str(tmp_path / "toy"), "--tp", "4", "--ep", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and named in err[0], err
    assert not (tmp_path / "p.sglang.json").exists()
