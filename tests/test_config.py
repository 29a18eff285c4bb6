"""Config loading: base defaults, experiment overrides, --set parsing and the errors users see."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import train
from backbones.trained import find_saved_backbone, parse_network_kw
from utils.config import ALIASES, BASE_CONFIG, ConfigError, _read_base, check_data_path, load_config
from utils.errors import WeightsError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def write(tmp_path: Path, text: str, name: str = "exp.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def base_keys() -> list[str]:
    tree = ast.parse(BASE_CONFIG.read_text())
    return [node.target.id for node in tree.body if isinstance(node, ast.AnnAssign)]


def test_every_base_key_is_annotated_and_commented():
    lines = BASE_CONFIG.read_text().splitlines()
    tree = ast.parse(BASE_CONFIG.read_text())
    plain = [node for node in tree.body if isinstance(node, ast.Assign)]
    assert not plain, "every key in base.py carries a type annotation"
    for node in tree.body:
        if isinstance(node, ast.AnnAssign):
            assert "#" in lines[node.lineno - 1], f"key {node.target.id} has no comment"
    needed = ("rec num_views view_source num_classes num_workers flip skip_bad_records seed network network_kwargs "
              "embedding_size dropout margin_list sample_rate view_weights interclass_filtering_threshold "
              "straight_through_margin fp16 bf16 optimizer lr momentum weight_decay batch_size gradient_acc num_epoch "
              "warmup_epoch frequent verbose val_targets output save_all_states resume max_nonfinite_steps").split()
    assert set(needed) <= set(base_keys())


def test_experiment_overrides_base_and_output_defaults_to_config_name(tmp_path):
    cfg = load_config(write(tmp_path, "network = 'r18'\nlr = 1\nimport os\n_helper = 3\n"))
    assert cfg.network == "r18"
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert cfg.momentum == 0.9 and cfg.num_views == 1  # untouched base values
    assert cfg.output == str(Path("output") / "exp")
    assert set(vars(cfg)) == set(base_keys())  # helpers (os, _helper) are not keys


def test_set_overrides_are_parsed_with_the_keys_type(tmp_path):
    cfg = load_config(write(tmp_path, "network = 'r50'\n"), [
        "network=r18", "lr=0.5", "num_epoch=3", "margin_list=[1, 0.4, 0]", "network_kwargs={'width_mult': 0.25}",
        "val_targets=['lfw', 'agedb_30']", "num_classes=None", "resume=True", "output=runs/42", "fp16=False"])
    assert cfg.network == "r18"
    assert cfg.lr == 0.5
    assert cfg.num_epoch == 3
    assert cfg.margin_list == (1.0, 0.4, 0.0) and all(isinstance(m, float) for m in cfg.margin_list)
    assert cfg.network_kwargs == {"width_mult": 0.25}
    assert cfg.val_targets == ("lfw", "agedb_30")
    assert cfg.num_classes is None
    assert cfg.resume is True
    assert cfg.output == "runs/42"  # a str key keeps the text even where it would parse otherwise


def test_set_a_string_key_to_a_number_keeps_the_text(tmp_path):
    assert load_config(write(tmp_path, ""), ["output=2024"]).output == "2024"
    assert load_config(write(tmp_path, ""), ["resume=output/run1"]).resume == "output/run1"


@pytest.mark.parametrize("where, key, suggestion", [
    ("file", "lrr", "lr"), ("file", "num_epochs", "num_epoch"), ("set", "embeding_size", "embedding_size"),
    ("set", "margin", "margin_list"), ("set", "learning_rate", "lr"), ("file", "epochs", "num_epoch"),
    ("set", "wd", "weight_decay")])
def test_unknown_key_names_it_and_the_closest_valid_key(tmp_path, where, key, suggestion):
    path = write(tmp_path, f"{key} = 1\n" if where == "file" else "")
    with pytest.raises(ConfigError) as info:
        load_config(path, [f"{key}=1"] if where == "set" else [])
    message = str(info.value)
    assert f"'{key}'" in message and f"did you mean '{suggestion}'" in message
    assert "\n" not in message


def test_every_alias_names_a_key_of_base_py():
    keys = _read_base()[1]
    assert not set(ALIASES) & set(keys) and set(ALIASES.values()) <= set(keys)


@pytest.mark.parametrize("text, overrides, key, expected", [
    ("lr = 'fast'\n", [], "lr", "float"),
    ("", ["num_epoch=2.5"], "num_epoch", "int"),
    ("", ["fp16=1"], "fp16", "bool"),
    ("", ["margin_list=(1, 'a', 0)"], "margin_list", "tuple[float, ...]"),
    ("", ["network_kwargs=3"], "network_kwargs", "dict"),
    ("", ["num_classes=1e3"], "num_classes", "int or None"),
])
def test_wrong_type_names_the_key_and_the_expected_type(tmp_path, text, overrides, key, expected):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), overrides)
    message = str(info.value)
    assert f"'{key}' must be {expected}" in message
    assert "\n" not in message


@pytest.mark.parametrize("overrides, fragment", [
    (["optimizer=adam"], "'optimizer' must be one of 'sgd', 'adamw', not str 'adam'"),
    (["view_source=pairs"], "'view_source' must be one of 'record', 'identity', 'augment', not str 'pairs'"),
    (["compile_backbone=fast"],
     "'compile_backbone' must be one of 'default', 'reduce-overhead', 'max-autotune' or None, not str 'fast'"),
    (["fp16=True", "bf16=True"], "'fp16' and 'bf16' are both True"),
    (["margin_list=(1.0, 0.5)"], "'margin_list' must hold three numbers"),
    (["sample_rate=-0.1"], "'sample_rate' must be in [0, 1], not -0.1; 1.0 uses every class centre"),
    (["sample_rate=1.5"], "'sample_rate' must be in [0, 1], not 1.5"),
    (["num_views=2", "view_weights=(1.0,)"], "'view_weights' has 1 weights but num_views is 2"),
    (["batch_size=0"], "'batch_size' must be at least 1"),
    (["warmup_epoch=5", "num_epoch=2"], "'warmup_epoch' (5) exceeds num_epoch (2)"),
    (["lr"], "is not key=value"),
])
def test_bad_values_are_refused_with_one_sentence(tmp_path, overrides, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_config(write(tmp_path, ""), overrides)


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.py")
    with pytest.raises(ConfigError, match="not a Python file"):
        load_config(write(tmp_path, "", "exp.yaml"))
    with pytest.raises(ConfigError, match="syntax error on line 2"):
        load_config(write(tmp_path, "lr = 0.1\nnetwork = (\n"))
    with pytest.raises(ConfigError, match=r"failed to run \(NameError"):
        load_config(write(tmp_path, "lr = undefined_name\n"))


def test_missing_data_path_is_a_config_error(tmp_path):
    cfg = load_config(write(tmp_path, f"rec = {str(tmp_path / 'absent')!r}\n"))
    with pytest.raises(ConfigError, match=r"config key 'rec' names data folder .*absent, which does not exist"):
        check_data_path(cfg)
    with pytest.raises(ConfigError, match="'rec' is empty"):
        check_data_path(load_config(write(tmp_path, "")))
    check_data_path(load_config(write(tmp_path, "rec = 'synthetic'\nnum_classes = 10\n")))


def test_shipped_configs_load_with_the_documented_values():
    pair = load_config(CONFIGS / "ms1mv3_r50_pair.py")
    assert (pair.num_views, pair.view_source, pair.network, pair.num_classes) == (2, "record", "r50", 93431)
    assert pair.margin_list == (1.0, 0.5, 0.0)
    assert (pair.lr, pair.weight_decay, pair.batch_size, pair.num_epoch, pair.fp16) == (0.1, 5e-4, 128, 20, True)
    single = load_config(CONFIGS / "ms1mv3_r50.py")
    assert (single.num_views, single.num_classes, single.network) == (1, 93431, "r50")
    identity = load_config(CONFIGS / "ms1mv3_r50_identity_pair.py")
    assert (identity.num_views, identity.view_source) == (2, "identity")
    assert identity.rec == single.rec  # the plain MS1MV3 .rec, views drawn from its identity table
    glint = load_config(CONFIGS / "glint360k_r100_pair.py")
    assert (glint.network, glint.num_classes, glint.sample_rate, glint.num_views) == ("r100", 360232, 0.1, 2)
    demo = load_config(CONFIGS / "synthetic_pair.py")
    assert demo.num_views == 2 and demo.val_targets
    families = {name: load_config(CONFIGS / f"{name}.py").margin_family for name in (
        "webface4m_r100_adaface", "ms1mv3_r50_pair_curricular", "ms1mv3_r50_pair_subcenter", "ms1mv3_r50_pair_elastic")}
    assert list(families.values()) == ["adaface", "curricular", "subcenter", "elastic_arc"]
    assert pair.margin_family == single.margin_family == glint.margin_family == "combined"


@pytest.mark.parametrize("override, message", [
    ("lr=-1", "config key 'lr' must not be negative, not -1.0; see configs/base.py"),
    ("momentum=-0.5", "config key 'momentum' must not be negative, not -0.5; see configs/base.py"),
    ("margin_scale=0", "config key 'margin_scale' must be positive, not 0.0; arcface_torch uses 64"),
    ("margin_list=(-1.0, 0.5, 0.0)", "config key 'margin_list' has m1=-1.0; the multiplicative margin must be "
                                     "positive (1.0 turns it off), e.g. margin_list=(1.0, 0.5, 0.0)"),
    ("network_kwargs={'width_mult': 'abc'}", "config key 'network_kwargs': network option 'width_mult' must be "
                                             "float, not str 'abc'; e.g. width_mult=0.25, num_features=512"),
])
def test_values_out_of_range_and_mistyped_network_options_are_one_line(capsys, override, message):
    assert train.main([str(CONFIGS / "synthetic_pair.py"), "--set", override, "--dry-run"]) == 1
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize("overrides, message", [
    (["margin_family=adaface", "adaface_t_alpha=1.5"], "config key 'adaface_t_alpha' must be in [0, 1] for "
     "margin_family='adaface', not 1.5; e.g. adaface_t_alpha=0.01 (the paper's)"),
    (["margin_family=curricular", "curricular_m=3.5"], "config key 'curricular_m' must be in [0, pi) for "
     "margin_family='curricular', not 3.5; e.g. curricular_m=0.5 (the paper's)"),
    (["margin_family=subcenter", "subcenter_k=1"], "config key 'subcenter_k' must be an integer from 2 to 255 for "
     "margin_family='subcenter', not 1; e.g. subcenter_k=3 (the paper's)"),
    (["margin_family=elastic_cos", "elastic_std=-0.1"], "config key 'elastic_std' must be at least 0 for "
     "margin_family='elastic_cos', not -0.1; e.g. elastic_std=None (the paper's)"),
    (["margin_family=elastic_arc", "interclass_filtering_threshold=0.3"], "config key "
     "'interclass_filtering_threshold' filters the combined margin's negatives only, not those of "
     "margin_family='elastic_arc'; set it to 0"),
])
def test_a_margin_familys_bad_value_is_one_line(capsys, overrides, message):
    assert train.main([str(CONFIGS / "synthetic_pair.py"), *[part for item in overrides for part in ("--set", item)],
                       "--dry-run"]) == 1
    assert capsys.readouterr().err == f"error: {message}\n"


def test_another_familys_keys_are_not_checked():
    assert load_config(CONFIGS / "synthetic_pair.py", ["subcenter_k=0"]).margin_family == "combined"


def test_mistyped_network_options_of_the_tools_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="--network-kw: network option 'width_mult' must be float, not str 'abc'"):
        parse_network_kw(["width_mult=abc"])
    (tmp_path / "model.json").write_text('{"network": "r18", "embedding_size": "x"}')
    (tmp_path / "backbone.pth").write_bytes(b"")
    with pytest.raises(WeightsError, match=r"model.json: network option 'num_features' must be int, not str 'x'"):
        find_saved_backbone(tmp_path)


def test_an_edict_file_without_config_names_what_it_defines(tmp_path):
    """Through the real command line: arcface_torch's style with the object named cfg."""
    config = write(tmp_path, "from easydict import EasyDict as edict\ncfg = edict()\ncfg.lr = 0.2\n")
    result = subprocess.run([sys.executable, "train.py", str(config), "--dry-run"], cwd=CONFIGS.parent,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr == (f"error: config file {config} defines no `config`, but the edict object(s) cfg; name the "
                             "object arcface_torch's way (config = edict()), or rename cfg to config\n")


@pytest.mark.parametrize("args, environ, message", [
    (["--world-size", "2"], {}, "--world-size only shapes the --dry-run report; add --dry-run, or drop --world-size "
                                "to train"),
    (["--json"], {}, "--json only shapes the --dry-run report; add --dry-run, or drop --json to train"),
    (["--dry-run", "--world-size", "0"], {}, "--world-size 0 plans for no process; pass a positive number of "
                                             "processes"),
    (["--dry-run", "--world-size", "-1"], {}, "--world-size -1 plans for no process; pass a positive number of "
                                              "processes"),
    (["--dry-run"], {"WORLD_SIZE": "x"}, "environment variable WORLD_SIZE='x' is not a number of processes; unset it "
                                         "or set it to a positive integer (torchrun sets it for you)"),
])
def test_dry_run_options_are_checked(capsys, monkeypatch, args, environ, message):
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert train.main([str(CONFIGS / "synthetic_pair.py"), *args]) == 1
    assert capsys.readouterr().err == f"error: {message}\n"


def test_train_help_points_at_base_py_for_the_keys(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exit_info.value.code == 0
    assert "any of configs/base.py's" in text and "Every config key, its default and what it does: configs/base.py." \
        in text
