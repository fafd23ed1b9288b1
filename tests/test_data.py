"""Real offline data: photo crops (CIFAR/Tiny-ImageNet shaped) and the 5k MNIST subset."""

import pytest
import torch

from fl_attack.testbed import data


@pytest.mark.parametrize(
    ("name", "shape", "n_classes"),
    [("photos32", (3, 32, 32), 8), ("photos64", (3, 64, 64), 8), ("mnist", (1, 28, 28), 10)],
)
def test_load_images_shapes_ranges_labels(name, shape, n_classes):
    x, y = data.load_images(name)
    n = 5000 if name == "mnist" else data.DEFAULT_PHOTO_POOL
    assert x.shape == (n, *shape) and x.dtype == torch.float32
    assert y.shape == (n,) and y.dtype == torch.int64
    assert data.image_shape(name) == shape
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert float(x.max()) > 0.9  # real 8-bit images use the range
    counts = torch.bincount(y, minlength=10)
    assert int((counts > 0).sum()) == n_classes
    # every class is well represented (photo chosen uniformly; MNIST ships 500 per digit)
    assert int(counts[counts > 0].min()) >= n // n_classes // 2


def test_load_images_deterministic_and_seeded():
    x1, y1 = data.load_images("photos32", 50)
    x1[:] = 0.0  # callers may modify what they get: the cache must not change
    x2, y2 = data.load_images("photos32", 50)
    x3, _ = data.load_images("photos32", 50)
    assert torch.equal(x2, x3) and torch.equal(y1, y2)
    assert float(x2.abs().sum()) > 0
    # the first n of the default pool
    assert torch.equal(data.load_images("photos32")[0][:50], x2)
    other, _ = data.load_images("photos32", 50, seed=1)
    assert not torch.equal(other, x2)
    # a pool grows on demand: asking for more never changes the first crops
    assert torch.equal(data.load_images("photos32", 20, seed=1)[0], other[:20])
    assert torch.equal(data.load_images("photos32", 80, seed=1)[0][:50], other)


def test_mnist_is_shuffled_deterministically():
    _, y0 = data.load_images("mnist", 100, seed=0)
    x0b, y0b = data.load_images("mnist", 100, seed=0)
    x1, y1 = data.load_images("mnist", 100, seed=1)
    assert torch.equal(y0, y0b)
    assert len(torch.unique(y0)) == 10  # rows ship sorted by label: must be shuffled
    assert not torch.equal(y0, y1)
    assert torch.equal(x0b, data.load_images("mnist", 100, seed=0)[0])
    assert 0.1 < float(x1.mean()) < 0.2  # real digits: mostly black background
    with pytest.raises(ValueError, match="5000"):
        data.load_images("mnist", 5001)


def test_photo_crops_are_textured_and_not_near_duplicates():
    x, _ = data.load_images("photos32")
    per_channel_std = x.flatten(2).std(dim=2).mean(dim=1)
    assert float(per_channel_std.min()) >= 0.04
    flat = x.flatten(1).double()
    sq = flat.pow(2).sum(1)
    mse = (sq[:, None] + sq[None] - 2 * flat @ flat.T) / flat.shape[1]
    mse.fill_diagonal_(float("inf"))
    assert float(mse.min()) > 1e-3 - 1e-9  # no two crops within 30 dB of each other


def test_mixed_crops_come_from_the_colour_and_the_grey_photographs():
    x, _ = data.load_images("mixed32", 340)
    grey = (x[:, 0] == x[:, 1]).flatten(1).all(1) & (x[:, 1] == x[:, 2]).flatten(1).all(1)
    # 8 of its 17 photographs are greyscale (scikit-image's); Grace Hopper is in colour
    assert 0.35 < float(grey.double().mean()) < 0.7
    assert data.image_shape("mixed32") == (3, 32, 32)


def test_ink28_is_one_channel_of_grey_sources_no_other_set_uses():
    """``ink28``: 1x28x28 crops of three greyscale images (labels 0-2), none of them a source
    of another crop set, with a plain ground and the full 8-bit range."""
    x, y = data.load_images("ink28", 300)
    assert x.shape == (300, 1, 28, 28) and data.image_shape("ink28") == (1, 28, 28)
    assert sorted(torch.unique(y).tolist()) == [0, 1, 2]
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0 and float(x.max()) > 0.9
    others = {s for name, srcs in data.PHOTO_SETS.items() if name != "ink28" for s in srcs}
    assert not others & set(data.INK_SOURCES)


@pytest.mark.parametrize("name", ["photos32", "photos64", "mnist", "ink28"])
def test_sample_batch_distinct_deterministic(name):
    x, y = data.sample_batch(name, 25, seed=3)
    assert x.shape == (25, *data.image_shape(name)) and y.shape == (25,)
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    flat = x.flatten(1)
    dist = torch.cdist(flat, flat)
    dist.fill_diagonal_(float("inf"))
    assert float(dist.min()) > 0  # no repeated image in the batch
    x2, y2 = data.sample_batch(name, 25, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = data.sample_batch(name, 25, seed=4)
    assert not torch.equal(x, x3)


def test_sample_batch_with_replacement_and_limits():
    x, _ = data.sample_batch("mnist", 5000, seed=0)
    assert x.shape[0] == 5000
    with pytest.raises(ValueError, match="5000"):
        data.sample_batch("mnist", 5001)
    x, _ = data.sample_batch("mnist", 6000, distinct=False)
    assert x.shape[0] == 6000
    with pytest.raises(ValueError, match="batch_size"):
        data.sample_batch("mnist", 0)


@pytest.mark.parametrize("name", ["photos32", "photos64", "mnist"])
def test_normalize_round_trip(name):
    x, _ = data.sample_batch(name, 8, seed=1)
    z = data.normalize(x, name)
    assert z.shape == x.shape
    assert torch.allclose(data.denormalize(z, name), x, atol=1e-6)
    # flat (B, C*H*W) rows normalise exactly like images
    zf = data.normalize(data.flatten(x), name)
    assert torch.allclose(zf, data.flatten(z))
    assert torch.allclose(data.unflatten(data.denormalize(zf, name), name), x, atol=1e-6)
    with pytest.raises(ValueError, match="neither"):
        data.normalize(x[:, :, :5], name)


def test_normalize_uses_dataset_statistics():
    x = torch.full((1, 3, 32, 32), 0.4914)
    assert abs(float(data.normalize(x, "photos32")[0, 0, 0, 0])) < 1e-6
    m = torch.full((1, 1, 28, 28), 0.1307 + 0.3081)
    assert torch.allclose(data.normalize(m, "mnist"), torch.ones_like(m))
    i = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1).expand(2, 3, 64, 64)
    assert float(data.normalize(i, "photos64").abs().max()) < 1e-6


def test_flatten_unflatten():
    x, _ = data.sample_batch("photos32", 4)
    f = data.flatten(x)
    assert f.shape == (4, 3072)
    assert torch.equal(data.unflatten(f, "photos32"), x)
    with pytest.raises(ValueError, match="3072"):
        data.unflatten(f[:, :100], "photos32")


def test_unknown_dataset_names_the_options():
    with pytest.raises(ValueError, match="photos32") as info:
        data.load_images("imagenet")
    assert "mnist" in str(info.value) and "cifar10" in str(info.value)
    with pytest.raises(ValueError, match="unknown dataset"):
        data.sample_batch("svhn", 4)
    with pytest.raises(ValueError, match="unknown dataset"):
        data.image_shape("svhn")


@pytest.mark.parametrize("name", ["cifar10", "mnist-torchvision"])
def test_torchvision_dataset_missing_files_is_a_clear_error(name, tmp_path):
    with pytest.raises(ValueError, match="download=True") as info:
        data.load_images(name, 10, root=str(tmp_path), download=False)
    assert str(tmp_path) in str(info.value) and name in str(info.value)
    with pytest.raises(ValueError, match=name):
        data.sample_batch(name, 4, root=str(tmp_path))
