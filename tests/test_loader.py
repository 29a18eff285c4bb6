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


# --- what mutation testing found unchecked ---------------------------------------------------------

def test_a_fresh_loader_walks_epoch_zero_from_its_first_batch(pair_rec):
    ds = build_dataset(pair_rec, num_views=2)
    order = list(DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=4, drop_last=True))
    got = [labels.tolist() for _, labels in build_loader(ds, 6, seed=4, num_workers=0)]
    assert got == [order[i:i + 6] for i in range(0, 30, 6)]


@pytest.mark.parametrize("batch_size, lengths", [(5, [5] * 6), (29, [29, 1]), (30, [30])])
def test_without_drop_last_the_last_batch_is_whatever_is_left(pair_rec, batch_size, lengths):
    loader = build_loader(build_dataset(pair_rec, num_views=2), batch_size, num_workers=0, drop_last=False)
    assert len(loader) == len(lengths) and [len(labels) for _, labels in loader] == lengths


def test_one_batch_is_enough_and_none_is_an_error(pair_rec):
    from dataset import DataError  # imported here: this section is appended to a file another change edits

    ds = build_dataset(pair_rec, num_views=2)
    assert len(build_loader(ds, 30, num_workers=0)) == 1
    with pytest.raises(DataError, match="give rank 0 of 1 no batch of 31"):
        build_loader(ds, 31, num_workers=0)


@pytest.mark.parametrize("rank, world_size, batch_size", [(2, 2, 4), (-1, 2, 4), (0, 1, 0)])
def test_impossible_setups_are_refused(pair_rec, rank, world_size, batch_size):
    with pytest.raises(ValueError, match="not a valid setup"):
        build_loader(build_dataset(pair_rec, num_views=2), batch_size, rank=rank, world_size=world_size)


def test_batch_size_one_and_the_last_rank_are_valid(pair_rec):
    loader = build_loader(build_dataset(pair_rec, num_views=2), 1, rank=1, world_size=2, num_workers=0)
    assert len(loader) == 15


@pytest.mark.parametrize("workers", [0, 1])
def test_a_bad_record_stops_the_loader_with_its_data_error(tmp_path, pair_rec, workers):
    """Without skip_bad_records the record's own one-sentence error reaches the training process, also
    from a worker process (not the worker's traceback)."""
    from dataset import DataError

    reader = RecordReader(f"{pair_rec}/train.idx", f"{pair_rec}/train.rec")
    with RecordWriter(str(tmp_path / "train.idx"), str(tmp_path / "train.rec")) as writer:
        for key in reader.keys:
            header, payload = unpack(reader.read(key))
            writer.write(key, pack(header, b"garbage" if key == 5 else payload))
    loader = build_loader(build_dataset(str(tmp_path), num_views=2), 30, num_workers=workers)
    with pytest.raises(DataError, match=r"record key 5 is not a decodable image") as raised:
        next(iter(loader))
    assert "Traceback" not in str(raised.value)


def test_loading_draws_nothing_from_torchs_global_generator(pair_rec):
    """Centre sampling and dropout draw from torch's global generator: a loader that drew from it (a
    DataLoader draws a worker seed at every epoch start) would change them at each epoch."""
    loader = build_loader(build_dataset(pair_rec, num_views=2), 4, num_workers=1)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    collect(loader, range(2))
    assert torch.equal(torch.get_rng_state(), state)


def test_the_skipped_count_travels_through_state_dict(pair_rec):
    ds = build_dataset(pair_rec, num_views=2)
    saved = build_loader(ds, 4, num_workers=0)
    saved.skipped = 3
    resumed = build_loader(ds, 4, num_workers=0)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.skipped == 3
