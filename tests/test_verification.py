"""eval.verification and eval.callback: .bin loading, 10-fold accuracy, embedding, the training callback.

References are computed independently: upstream's loop-per-threshold algorithm with sklearn's
KFold and a segment-by-segment walk of the FAR curve (references/verification.py), dense float64 embeddings
from one direct forward pass, ROC points by hand.
"""
from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.model_selection import KFold
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from eval.callback import VerificationCallback
from eval.folds import verification_folds
from eval.roc import roc_points, tar_at_far
from eval.verification import evaluate, fold_note, load_bin
from eval.verification import test as verification_test
from references.verification import planted_pairs, reference_evaluate
from tests.distributed_helpers import run_world
from utils.errors import ConfigError, DataError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "recordio")
VERIFY_BIN = os.path.join(FIXTURES, "verify.bin")
VERIFY_NP_BIN = os.path.join(FIXTURES, "verify_np.bin")

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------
# Independent reference: upstream's calculate_roc / calculate_val, one threshold at a time (references/verification.py),
# on folds of each kind of pair.

def reference_stratified_folds(issame, nrof_folds):
    """Fold i tests the i-th of KFold's contiguous runs of the same-person pairs and the i-th of the
    different-person pairs."""
    same, different = np.flatnonzero(issame), np.flatnonzero(~np.asarray(issame))
    runs = [[kind[test] for _, test in KFold(n_splits=nrof_folds).split(kind)] for kind in (same, different)]
    tests = [np.sort(np.r_[a, b]) for a, b in zip(*runs)]
    return [(np.setdiff1d(np.arange(len(issame)), test), test) for test in tests]


@pytest.mark.parametrize("num_pairs, noise, seed", [(200, 1.0, 0), (57, 0.7, 1)])
def test_evaluate_equals_brute_force_reference(num_pairs, noise, seed):
    embeddings, issame = planted_pairs(num_pairs, 16, noise, seed)
    got = evaluate(embeddings, issame, nrof_folds=10)
    want = reference_evaluate(embeddings, issame, nrof_folds=10)
    for name, g, w in zip(("tpr", "fpr", "accuracy", "val", "val_std", "far"), got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12, err_msg=name)
    assert 0.6 < got[2].mean() < 1.0  # the planted structure is found, imperfectly


def test_val_threshold_is_interpolated_between_grid_points():
    """Per fold: one impostor at squared distance 1.0007, 499 at 3.0, 10 genuine at 0.5 and 10 at 1.0003.

    On the train fold FAR is 0 at threshold 1.000 and 1/500 at 1.001, so FAR 1e-3 lies half-way:
    threshold 1.0005, which accepts the 1.0003 genuine pairs of the test fold (VAL 1, FAR 0). The
    grid point below it (1.000) would accept only half (VAL 0.5).
    """
    fold = np.r_[[1.0007], np.full(499, 3.0), np.full(10, 0.5), np.full(10, 1.0003)]
    fold_issame = [False] * 500 + [True] * 20
    dist = np.r_[fold, fold]
    embeddings = np.zeros((2 * dist.size, 2))
    embeddings[1::2, 0] = np.sqrt(dist)
    issame = fold_issame * 2
    _, _, _, val, val_std, far = evaluate(embeddings, issame, nrof_folds=2)
    assert (val, val_std, far) == (1.0, 0.0, 0.0)
    assert (val, val_std, far) == pytest.approx(reference_evaluate(embeddings, issame, 2)[3:], abs=1e-12)


def test_evaluate_is_perfect_on_separable_pairs_and_chance_on_random_ones():
    embeddings, issame = planted_pairs(400, 32, 0.0, 3)  # genuine pairs identical: distance 0
    _, _, accuracy, val, _, _ = evaluate(embeddings, issame)
    assert accuracy.tolist() == [1.0] * 10 and val == 1.0

    rng = np.random.default_rng(4)
    random_embeddings = rng.standard_normal((2 * 3000, 32))
    random_embeddings /= np.linalg.norm(random_embeddings, axis=1, keepdims=True)
    accuracy = evaluate(random_embeddings, (rng.random(3000) < 0.5).tolist())[2]
    assert abs(accuracy.mean() - 0.5) < 0.04


def test_evaluate_handles_fewer_pairs_than_folds():
    """Two same and one different pair: one fold, its threshold chosen and scored on the whole set."""
    embeddings, _ = planted_pairs(3, 8, 0.0, 5)
    issame = [True, False, True]
    accuracy = evaluate(embeddings, issame, nrof_folds=10)[2]
    everything = np.arange(3)
    assert accuracy.tolist() == reference_evaluate(embeddings, issame, folds=[(everything, everything)])[2].tolist()
    assert verification_folds(np.array(issame), 10).note.startswith("1 pairs of one kind cannot fill 10 folds")
    with pytest.raises(ValueError, match="two per pair"):
        evaluate(embeddings[:5], issame)


def lfw_ordered(blocks, per_kind):
    """issame of lfw.bin's layout: ``blocks`` runs of ``per_kind`` same-person then ``per_kind`` different pairs."""
    return np.tile(np.r_[np.ones(per_kind, bool), np.zeros(per_kind, bool)], blocks)


def test_sets_in_arcface_torch_s_layout_keep_its_contiguous_folds_exactly():
    issame = lfw_ordered(10, 6)
    folds = verification_folds(issame, 10)
    want = list(KFold(n_splits=10, shuffle=False).split(np.arange(issame.size)))
    assert folds.note is None
    for (train, test), (want_train, want_test) in zip(folds.splits, want, strict=True):
        assert train.tolist() == want_train.tolist() and test.tolist() == want_test.tolist()
    embeddings, _ = planted_pairs(issame.size, 16, 1.0, 7)
    np.testing.assert_allclose(evaluate(embeddings, issame)[2], reference_evaluate(embeddings, issame)[2], atol=1e-12)


def test_a_set_listing_its_same_pairs_first_is_scored_on_folds_holding_both_kinds():
    """pairsDevTest's order (all same-person pairs, then all different): 10 folds of 5 + 5, not 10 of one kind."""
    issame = np.r_[np.ones(50, bool), np.zeros(50, bool)]
    folds = verification_folds(issame, 10)
    for _, test in folds.splits:
        assert issame[test].sum() == 5 and (~issame[test]).sum() == 5
    assert folds.note == ("contiguous folds would hold one kind of pair only: scored on 10 stratified folds of "
                          "5 same + 5 different pairs")
    embeddings, _ = planted_pairs(issame.size, 16, 1.0, 8)
    got = evaluate(embeddings, issame)
    want = reference_evaluate(embeddings, issame, folds=reference_stratified_folds(issame, 10))
    for name, g, w in zip(("tpr", "fpr", "accuracy", "val", "val_std", "far"), got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12, err_msg=name)


def test_a_collapsed_model_reads_chance_not_zero_on_a_same_pairs_first_set():
    """Every embedding equal (the seed report's failure): each fold's threshold accepts nothing or everything,
    and half of every balanced fold is then right."""
    issame = np.r_[np.ones(50, bool), np.zeros(50, bool)]
    collapsed = np.tile([[1.0, 0.0]], (200, 1))
    assert evaluate(collapsed, issame)[2].tolist() == [0.5] * 10


def test_a_set_of_one_kind_of_pair_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="4 same-person pairs and no others"):
        verification_folds(np.ones(4, bool), 10)
    with pytest.raises(DataError, match=r"^only_same.bin: the set holds 4 same-person pairs and no others; .*"
                                        "tools.make_bin"):
        fold_note("only_same.bin", [True] * 4)


# ---------------------------------------------------------------------------------------------
# .bin loading

def test_fixture_bins_load_with_bytes_and_numpy_entries():
    expected = json.load(open(os.path.join(FIXTURES, "expected.json")))["files"]["verify"]
    (original, flipped), issame = load_bin(VERIFY_BIN)
    (original_np, flipped_np), issame_np = load_bin(VERIFY_NP_BIN)
    assert issame == issame_np == expected["issame"]
    assert original.shape == (2 * expected["pairs"], 3, 112, 112) and original.dtype == torch.uint8
    # Pixel sums of the images as mxnet's cv2 decoded them when writing the fixture.
    assert original.sum(dim=(1, 2, 3)).tolist() == expected["decoded_rgb_sums"]
    assert torch.equal(original, original_np) and torch.equal(flipped, flipped_np)
    assert torch.equal(flipped, torch.from_numpy(original.numpy()[:, :, :, ::-1].copy()))


def _jpeg(color, size):
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="JPEG", quality=100)
    return buffer.getvalue()


def _write_pickle(path, obj, protocol=pickle.HIGHEST_PROTOCOL):
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=protocol)
    return str(path)


def test_load_bin_resizes_other_sizes_and_reads_numpy_issame(tmp_path):
    bins = [_jpeg((200, 40, 90), (96, 128)), np.frombuffer(_jpeg((10, 250, 30), (150, 150)), np.uint8)]
    path = _write_pickle(tmp_path / "odd.bin", (bins, np.array([False])), protocol=2)
    (original, _), issame = load_bin(path, image_size=(112, 112))
    assert original.shape == (2, 3, 112, 112) and issame == [False]
    means = original.float().mean(dim=(2, 3))
    np.testing.assert_allclose(means.numpy(), [[200, 40, 90], [10, 250, 30]], atol=3)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("make, message", [
    (lambda d: str(d / "absent.bin"), "does not exist"),
    (lambda d: (d / "text.bin").write_text("hello") and str(d / "text.bin"), "not a verification .bin"),
    (lambda d: _write_pickle(d / "odd.bin", ([_jpeg((0, 0, 0), (112, 112))] * 3, [True])), "two images per pair"),
    (lambda d: _write_pickle(d / "broken.bin", ([b"not a jpeg", b"x"], [True])), "image 0 cannot be decoded"),
    (lambda d: _write_pickle(d / "exploit.bin", ([_Exploit()], [True])), "posix.system|os.system"),
])
def test_load_bin_errors_name_the_file(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(DataError, match=message) as error:
        load_bin(path)
    assert path in str(error.value)


# ---------------------------------------------------------------------------------------------
# test(): batched embedding

class TinyNet(nn.Module):
    """A CNN with BatchNorm (eval and train mode differ) and a frozen layer that must stay frozen."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 5, stride=8)
        self.bn = nn.BatchNorm2d(4)
        self.frozen = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 14 * 14, 8)
        with torch.no_grad():
            for bn in (self.bn, self.frozen):
                bn.running_mean.uniform_(-0.1, 0.1)
                bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        return self.fc(self.frozen(self.bn(self.conv(x))).flatten(1))


def reference_embeddings(model, images):
    """Dense float64 forward of the whole set at once, in eval mode."""
    model = model.double().eval()
    with torch.no_grad():
        out = model(images.double() / 127.5 - 1.0).numpy()
    model.float()
    return out


def test_three_pairs_embed_with_batch_ten_and_match_a_direct_forward():
    (original, flipped), issame = load_bin(VERIFY_BIN)
    data_set = ([original[:6], flipped[:6]], issame[:3])
    model = TinyNet().train()
    model.frozen.eval()

    acc1, std1, acc2, std2, xnorm, embeddings_list = verification_test(data_set, model, batch_size=10, nfolds=10)

    assert model.training and model.bn.training and not model.frozen.training
    want = [reference_embeddings(TinyNet(), view) for view in (original[:6], flipped[:6])]
    for got, ref in zip(embeddings_list, want):
        assert got.shape == (6, 8)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(xnorm, np.linalg.norm(np.concatenate(want), axis=1).mean(), rtol=1e-5)
    fused = want[0] + want[1]
    whole_set = [(np.arange(3), np.arange(3))]  # a single different pair: one fold, the whole set
    accuracy2 = reference_evaluate(fused / np.linalg.norm(fused, axis=1, keepdims=True), issame[:3],
                                   folds=whole_set)[2]
    accuracy1 = reference_evaluate(want[0] / np.linalg.norm(want[0], axis=1, keepdims=True), issame[:3],
                                   folds=whole_set)[2]
    assert (acc2, std2) == pytest.approx((accuracy2.mean(), accuracy2.std()))
    assert (acc1, std1) == pytest.approx((accuracy1.mean(), accuracy1.std()))

    for batch_size in (1, 4, 64):
        again = verification_test(data_set, model, batch_size=batch_size)[5]
        np.testing.assert_allclose(again[0], embeddings_list[0], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# ROC / TAR

def test_tar_at_far_matches_hand_computed_values():
    # Impostors: 0.9 0.5 0.4 0.2 0.1 ; genuine: 0.95 0.85 0.6 0.5 0.3 (0.5 is a tie across classes).
    scores = np.array([0.9, 0.95, 0.5, 0.85, 0.4, 0.6, 0.2, 0.5, 0.1, 0.3])
    labels = np.array([0, 1, 0, 1, 0, 1, 0, 1, 0, 1])
    fpr, tpr, thresholds = roc_points(scores, labels)
    np.testing.assert_allclose(fpr, [0, 0, 0.2, 0.2, 0.2, 0.4, 0.6, 0.6, 0.8, 1.0])
    np.testing.assert_allclose(tpr, [0, 0.2, 0.2, 0.4, 0.6, 0.8, 0.8, 1.0, 1.0, 1.0])
    assert thresholds[0] == np.inf and thresholds[-1] == 0.1
    # FAR 0.1 < 1/5: no impostor may pass -> only 0.95. FAR 0.2: threshold down to 0.6 -> 3 of 5.
    # FAR 0.4: down to the tie at 0.5 -> 4 of 5. FAR 0.59: still 4 of 5.
    assert tar_at_far(scores, labels, (0.1, 0.2, 0.4, 0.59, 1.0)) == {0.1: 0.2, 0.2: 0.6, 0.4: 0.8, 0.59: 0.8,
                                                                      1.0: 1.0}
    with pytest.raises(ValueError, match="genuine and impostor"):
        tar_at_far(scores[labels == 1], labels[labels == 1])


# ---------------------------------------------------------------------------------------------
# VerificationCallback

UPSTREAM_LINES = [
    r"\[(lfw|verify_np)\]\[(\d+)\]XNorm: \d+\.\d{6}$",
    r"\[(lfw|verify_np)\]\[(\d+)\]Accuracy-Flip: \d\.\d{5}\+-\d\.\d{5}$",
    r"\[(lfw|verify_np)\]\[(\d+)\]Accuracy-Highest: \d\.\d{5}$",
    # ours, after upstream's three: the accuracy model.json records with the threshold, named apart
    r"\[(lfw|verify_np)\]\[(\d+)\]Accuracy-At-Threshold: \d\.\d{5} at cosine similarity ",
]


def test_callback_logs_upstream_lines_writes_tensorboard_and_restores_modes(tmp_path, caplog):
    shutil.copy(VERIFY_BIN, tmp_path / "lfw.bin")
    writer = SummaryWriter(str(tmp_path / "tb"))
    callback = VerificationCallback(every=3, val_targets=["lfw", VERIFY_NP_BIN], rec_prefix=str(tmp_path),
                                    batch_size=7, metrics=writer)
    model = TinyNet().train()
    caplog.set_level(logging.INFO, logger="eval.callback")
    caplog.clear()  # what loading the sets said (a fold note) reaches caplog only when an earlier test left INFO on

    def lines() -> list[str]:  # the callback's own lines (whether others reach caplog depends on earlier tests)
        return [record.getMessage() for record in caplog.records if record.name == "eval.callback"]

    assert callback(0, model) is None and callback(2, model) is None and not lines()
    results = callback(3, model)
    assert set(results) == {"lfw", "verify_np"} and model.training and model.bn.training
    lines = lines()
    assert len(lines) == 8
    for line, pattern in zip(lines, UPSTREAM_LINES * 2):
        match = re.match(pattern, line)
        assert match and match.group(2) == "3", line
    assert f"Accuracy-Flip: {results['lfw']:1.5f}+-" in lines[1]

    final = callback.evaluate_now(model)
    assert final == results  # same weights, same numbers; logged at the last step seen
    assert "[lfw][3]XNorm" in caplog.records[-8].getMessage()
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"lfw", "verify_np", "xnorm/lfw"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("lfw")] == [3, 3]
    assert events.Scalars("lfw")[0].value == pytest.approx(results["lfw"])


def test_callback_rejects_a_missing_target_naming_the_key_and_path(tmp_path):
    with pytest.raises(ConfigError, match=r"val_targets entry 'agedb_30'.*agedb_30\.bin"):
        VerificationCallback(every=1, val_targets=["agedb_30"], rec_prefix=str(tmp_path))


def _callback_in_world(rank, world_size, rec_prefix):
    try:
        VerificationCallback(every=2, val_targets=["lfw", "missing"], rec_prefix=rec_prefix)
        missing_error = None
    except ConfigError as error:
        missing_error = str(error)
    model = nn.parallel.DistributedDataParallel(TinyNet())
    callback = VerificationCallback(every=2, val_targets=["lfw"], rec_prefix=rec_prefix, batch_size=16)
    result = callback(4, model)
    torch.distributed.barrier()  # the non-main rank must not be stuck waiting for the main one
    return missing_error, result, sorted(callback.sets), model.training


def test_callback_evaluates_on_the_main_rank_only_through_ddp(tmp_path):
    shutil.copy(VERIFY_BIN, tmp_path / "lfw.bin")
    main, other = run_world(_callback_in_world, 2, str(tmp_path))
    # Every rank raises the main rank's verdict on a missing set, so none waits for a dead one.
    assert all(error is not None and "missing.bin" in error for error in (main[0], other[0]))
    _, main_result, main_sets, main_training = main
    _, other_result, other_sets, _ = other
    assert set(main_result) == {"lfw"} and main_sets == ["lfw"] and main_training
    assert other_result is None and other_sets == []
