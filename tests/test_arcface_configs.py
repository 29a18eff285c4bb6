"""arcface_torch's config files run unchanged: written here as its configs/ folder writes them (an
edict named config, its full key set), read through `train.py CONFIG --dry-run`, they mean what they
say; its keys pairface did not have are honoured; a misspelt key is named in either style."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import train
from tests.run_helpers import run_here
from utils.config import load_config
from utils.errors import ConfigError

HEADER = '''from easydict import EasyDict as edict

# make training faster
# our RAM is 256G
# mount -t tmpfs -o size=140G  tmpfs /train_tmp

config = edict()
'''
RECIPES = {
    "ms1mv3_r50": '''
config.margin_list = (1.0, 0.5, 0.0)
config.network = "r50"
config.resume = False
config.output = None
config.embedding_size = 512
config.sample_rate = 1.0
config.fp16 = True
config.momentum = 0.9
config.weight_decay = 5e-4
config.batch_size = 128
config.lr = 0.1
config.verbose = 2000
config.dali = False

config.rec = "/train_tmp/ms1m-retinaface-t1"
config.num_classes = 93431
config.num_image = 5179510
config.num_epoch = 20
config.warmup_epoch = 0
config.val_targets = ['lfw', 'cfp_fp', "agedb_30"]
''',
    "glint360k_r100_pfc01": '''
config.margin_list = (1.0, 0.0, 0.4)
config.network = "r100"
config.resume = False
config.output = None
config.embedding_size = 512
config.sample_rate = 0.1
config.interclass_filtering_threshold = 0
config.fp16 = True
config.momentum = 0.9
config.weight_decay = 1e-4
config.batch_size = 128
config.lr = 0.1
config.verbose = 2000
config.dali = False

config.rec = "/train_tmp/glint360k"
config.num_classes = 360232
config.num_image = 17091657
config.num_epoch = 20
config.warmup_epoch = 0
config.val_targets = ['lfw', 'cfp_fp', "agedb_30"]
''',
    "wf42m_vit_t_dali": '''
config.margin_list = (1.0, 0.0, 0.4)
config.network = "vit_t_dp005_mask0"
config.resume = False
config.output = None
config.embedding_size = 512
config.sample_rate = 0.3
config.fp16 = True
config.weight_decay = 0.1
config.batch_size = 512
config.optimizer = "adamw"
config.lr = 0.001
config.verbose = 2000
config.dali = True
config.dali_aug = True
config.gradient_acc = 4

config.rec = "/train_tmp/WebFace42M"
config.num_classes = 2059906
config.num_image = 42474557
config.num_epoch = 40
config.warmup_epoch = config.num_epoch // 10
config.val_targets = []
''',
    "wf42m_pfc0008_32gpu_r100": '''
config.margin_list = (1.0, 0.0, 0.4)
config.network = "r100"
config.resume = False
config.output = None
config.embedding_size = 512
config.sample_rate = 0
config.fp16 = True
config.momentum = 0.9
config.weight_decay = 5e-4
config.batch_size = 512
config.lr = 0.4
config.verbose = 2000
config.dali = False

config.rec = "/train_tmp/WebFace42M"
config.num_classes = 2059906
config.num_image = 42474557
config.num_epoch = 20
config.warmup_epoch = config.num_epoch // 10
config.val_targets = ["lfw", "cfp_fp", "agedb_30"]
''',
    "wandb_base": '''
config.margin_list = (1.0, 0.5, 0.0)
config.network = "r50"
config.resume = False
config.save_all_states = False
config.output = "ms1mv3_arcface_r50"
config.embedding_size = 512
config.sample_rate = 1
config.interclass_filtering_threshold = 0
config.fp16 = False
config.batch_size = 128
config.optimizer = "sgd"
config.lr = 0.1
config.momentum = 0.9
config.weight_decay = 5e-4
config.verbose = 2000
config.frequent = 10
config.dali = False
config.dali_aug = False
config.gradient_acc = 1
config.seed = 2048
config.num_workers = 2
config.wandb_key = "XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX"
config.suffix_run_name = None
config.using_wandb = False
config.wandb_entity = "entity"
config.wandb_project = "project"
config.wandb_log_all = True
config.save_artifacts = False
config.wandb_resume = False
config.rec = "/train_tmp/ms1m-retinaface-t1"
config.num_classes = 93431
config.num_image = 5179510
config.num_epoch = 20
config.warmup_epoch = 0
config.val_targets = ['lfw', 'cfp_fp', "agedb_30"]
''',
}


def written(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / "configs" / f"{name}.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(HEADER + textwrap.dedent(body))
    return path


def the_files_own_values(path: Path) -> dict:
    """What the file says, read the way arcface_torch reads it: run it and take its edict."""
    names: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), names)
    return dict(names["config"])


def dry_run(path: Path, capsys, *extra: str) -> dict:
    assert train.main([str(path), "--dry-run", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", RECIPES)
def test_an_arcface_torch_config_file_means_what_it_says(tmp_path, capsys, name):
    path = written(tmp_path, name, RECIPES[name])
    resolved = dry_run(path, capsys, "--world-size", "8")
    config = resolved["config"]
    for key, value in the_files_own_values(path).items():
        expected = f"output/{name}" if key == "output" and value is None else value
        assert config[key] == (list(expected) if isinstance(expected, tuple) else expected), key
    defaults = load_config(written(tmp_path, "empty", ""))
    untouched = set(vars(defaults)) - set(the_files_own_values(path)) - {"output"}
    assert {key: config[key] for key in untouched} == json.loads(json.dumps({k: vars(defaults)[k] for k in untouched}))
    memory = resolved["memory"]
    assert memory["world_size"] == 8 and memory["total"] > memory["class_centres"] > 0


def test_the_webface_vit_recipe_plans_its_sampled_logits_and_adamw_state(tmp_path, capsys):
    memory = dry_run(written(tmp_path, "wf42m", RECIPES["wf42m_vit_t_dali"]), capsys, "--world-size", "8")["memory"]
    rows = 2059906 // 8 + 1  # 2059906 = 8 x 257488 + 2: ranks 0 and 1 hold one more
    assert memory["class_centres"] == rows * 512 * 4
    assert memory["centre_optimizer_state"] == 2 * memory["class_centres"]  # AdamW: two moments
    samples, columns = 512 * 1 * 8, int(0.3 * rows)  # batch x views x processes, 30% of the centres
    assert memory["logits_buffer"] >= samples * columns * 4


def test_sample_rate_zero_plans_a_column_for_every_label_of_the_global_batch(tmp_path, capsys):
    """arcface_torch's sample_rate = 0 on its 32 GPUs: only the step's positive classes, at most one per label
    of the global batch (512 x 32), far fewer than the 64373 centres rank 0 holds."""
    path = written(tmp_path, "wf42m_pfc0008_32gpu_r100", RECIPES["wf42m_pfc0008_32gpu_r100"])
    resolved = dry_run(path, capsys, "--world-size", "32")
    assert resolved["config"]["sample_rate"] == 0
    samples = labels = 512 * 32  # one view
    assert samples * labels * 4 <= resolved["memory"]["logits_buffer"] < samples * 2 * labels * 4


def test_a_misspelt_key_is_named_with_the_closest_in_either_style(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"unknown config key 'sample_rat' in config file .*; did you mean "
                                          r"'sample_rate'\?"):
        load_config(written(tmp_path, "edict_typo", "config.sample_rat = 0.1\n"))
    plain = tmp_path / "plain_typo.py"
    plain.write_text("sample_rat = 0.1\n")
    with pytest.raises(ConfigError, match="did you mean 'sample_rate'"):
        load_config(plain)


def test_two_view_training_of_an_arcface_recipe_is_two_overrides(tmp_path, capsys):
    path = written(tmp_path, "ms1mv3_r50", RECIPES["ms1mv3_r50"])
    config = dry_run(path, capsys, "--set", "num_views=2", "--set", 'view_source="identity"')["config"]
    assert (config["num_views"], config["view_source"], config["num_image"]) == (2, "identity", 5179510)


def test_the_dry_run_reads_no_data_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = written(tmp_path, "ms1mv3_r50", RECIPES["ms1mv3_r50"])  # its rec does not exist here
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert train.main([str(path), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "num_image = 5179510" in text and "memory per process, 1 process(es)" in text
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_num_image_is_checked_against_the_data(data, tmp_path, capsys):
    status, stderr = run_here(data, tmp_path / "run", "num_image=41")
    assert status == 1
    assert stderr.strip() == (f"error: {data} holds 40 samples but num_image=41; set num_image = 40 (or None) in "
                              "the config")
