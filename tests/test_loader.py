"""The loader: DistributedSampler's order, worker-independent batches, exact mid-epoch resume."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from dataset import (
    InsightfaceWriter,
    RecordReader,
    RecordWriter,
    build_dataset,
    build_loader,
    encode,
    pack,
    render_faces,
    side_by_side,
    unpack,
)

NUM_SAMPLES = 30


@pytest.fixture(scope="module")
def pair_rec(tmp_path_factory) -> str:
    """One two-view record per identity, so a label names its sample index."""
    out = tmp_path_factory.mktemp("pairs")
    faces = render_faces(range(NUM_SAMPLES), 0, seed=1), render_faces(range(NUM_SAMPLES), 1, seed=1)
    with InsightfaceWriter(str(out)) as writer:
        for identity in range(NUM_SAMPLES):
            writer.write_identity([encode(side_by_side([faces[0][identity], faces[1][identity]]))])
    return str(out)


def collect(loader, epochs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        batches += [(images.clone(), labels.clone()) for images, labels in loader]
    return batches


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for (images, labels), (want_images, want_labels) in zip(got, expected):
        assert torch.equal(labels, want_labels) and torch.equal(images, want_images)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_order_is_distributed_samplers(pair_rec, world_size):
    ds = build_dataset(pair_rec, num_views=2)
    for rank in range(world_size):
        loader = build_loader(ds, 4, rank=rank, world_size=world_size, seed=5, num_workers=0)
        reference = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=5, drop_last=True)
        for epoch in (0, 3):
            loader.set_epoch(epoch)
            reference.set_epoch(epoch)
            order = list(reference)
            expected = [order[i:i + 4] for i in range(0, len(order) - len(order) % 4, 4)]
            got = [labels.tolist() for _, labels in loader]
            assert got == expected and len(loader) == len(expected)


def test_ranks_take_disjoint_slices(pair_rec):
    ds = build_dataset(pair_rec, num_views=2)
    seen = [set(torch.cat([labels for _, labels in build_loader(ds, 3, rank=r, world_size=2, num_workers=0)]).tolist())
            for r in range(2)]
    assert not seen[0] & seen[1] and len(seen[0]) == len(seen[1]) == 15


def test_batches_do_not_depend_on_num_workers(pair_rec):
    ds = build_dataset(pair_rec, num_views=2, flip=True, seed=7)
    single = collect(build_loader(ds, 4, seed=1, num_workers=0), range(2))
    assert_same_batches(collect(build_loader(ds, 4, seed=1, num_workers=2), range(2)), single)
    first = single[0][0]
    assert first.shape == (4, 2, 3, 112, 112) and first.dtype == torch.uint8


@pytest.mark.parametrize("start", [3, 7, 14])  # mid-epoch, last batch of an epoch, mid second epoch
def test_steps_from_any_start_are_the_uninterrupted_batches(pair_rec, start):
    """A resumed run asks for the steps from its saved step on: it gets what the uninterrupted run got."""
    ds = build_dataset(pair_rec, num_views=2, flip=True, seed=7)
    uninterrupted = collect(build_loader(ds, 4, seed=2, num_workers=0), range(3))  # 7 batches per epoch
    resumed = build_loader(ds, 4, seed=2, num_workers=1)
    steps = list(resumed.steps(start, 21))
    assert all(len(micro_batches) == 1 for micro_batches in steps)
    assert_same_batches([micro_batches[0] for micro_batches in steps], uninterrupted[start:])


def test_steps_group_micro_batches_and_drop_an_epochs_leftover(pair_rec):
    """7 batches per epoch, 2 per step: 3 steps an epoch, the 7th batch of each epoch unused."""
    ds = build_dataset(pair_rec, num_views=2, seed=7)
    batches = collect(build_loader(ds, 4, seed=2, num_workers=0), range(2))
    steps = list(build_loader(ds, 4, seed=2, num_workers=0).steps(1, 5, batches_per_step=2))
    expected = [batches[2:4], batches[4:6], batches[7:9], batches[9:11]]
    assert len(steps) == 4
    for got, want in zip(steps, expected):
        assert_same_batches(got, want)


def test_length_and_drop_last(pair_rec):
    ds = build_dataset(pair_rec, num_views=2)
    kept = build_loader(ds, 4, world_size=2, num_workers=0)
    assert len(kept) == 3 and [len(label) for _, label in kept] == [4, 4, 4]
    partial = build_loader(ds, 4, world_size=2, num_workers=0, drop_last=False)
    assert len(partial) == 4 and [len(label) for _, label in partial] == [4, 4, 4, 3]


def test_skipped_records_are_summed_over_workers(tmp_path, pair_rec):
    # Damage two records; each time the epoch meets one, the next sample stands in and it is counted.
    reader = RecordReader(f"{pair_rec}/train.idx", f"{pair_rec}/train.rec")
    bad_keys = {5, 17}
    with RecordWriter(str(tmp_path / "train.idx"), str(tmp_path / "train.rec")) as writer:
        for key in reader.keys:
            header, payload = unpack(reader.read(key))
            writer.write(key, pack(header, b"garbage" if key in bad_keys else payload))
    ds = build_dataset(str(tmp_path), num_views=2, skip_bad_records=True)
    loader = build_loader(ds, 4, seed=3, num_workers=2)
    order = list(DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=3, drop_last=True))
    expected = sum(1 for i in order[:len(loader) * 4] if i + 1 in bad_keys)  # sample i is key i + 1
    labels = torch.cat([labels for _, labels in loader])
    assert loader.skipped == expected > 0
    assert set(labels.tolist()).isdisjoint({k - 1 for k in bad_keys})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_batches_arrive_on_the_device_unchanged(pair_rec):
    ds = build_dataset(pair_rec, num_views=2, seed=4)
    on_cpu = collect(build_loader(ds, 4, num_workers=0), range(2))
    on_gpu = collect(build_loader(ds, 4, num_workers=2, device="cuda"), range(2))
    assert all(images.is_cuda and labels.is_cuda for images, labels in on_gpu)
    assert_same_batches([(i.cpu(), label.cpu()) for i, label in on_gpu], on_cpu)
