import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A graceful stop drains AOT_DRAIN_SECONDS first: the tests' servers stop at once, except where the drain is tested
# (tests/test_graceful_stop.py, which names its own).
os.environ.setdefault("AOT_DRAIN_SECONDS", "0")
# The tests' step processes share a host cache of their own (aot.serving.store.host_cache), not the machine's.
os.environ.setdefault("AOT_HOST_CACHE_DIR", tempfile.mkdtemp(prefix="aot-host-cache-"))

import pytest
import torch

from tests.tiny import ARCHS, save_tiny_model, tiny_backbone, write_sentiment_folder

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    """Saved tiny model folders, one per architecture."""
    root = tmp_path_factory.mktemp("models")
    return {arch: save_tiny_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture
def backbone(arch):
    return tiny_backbone(arch)


@pytest.fixture(scope="session")
def sentiment_dir(tmp_path_factory):
    return write_sentiment_folder(tmp_path_factory.mktemp("data") / "sentiment")


@pytest.fixture(scope="session")
def kind_artifacts(tmp_path_factory, tiny_models, sentiment_dir) -> dict:
    """One FC task of every kind on the tiny BERT (tests.tiny.KIND_TASKS): name -> artifact folder
    (tests/test_kinds*.py)."""
    from tests.helpers import train_tiny_task
    from tests.tiny import KIND_TASKS, write_kind_folder

    root = tmp_path_factory.mktemp("kinds")
    return {"cls": train_tiny_task(tiny_models["bert"], sentiment_dir, root / "cls", epochs=2),
            **{name: train_tiny_task(tiny_models["bert"], write_kind_folder(root / f"data-{kind}", kind), root / name,
                                     problem=kind, epochs=6)
               for name, kind in KIND_TASKS.items() if name != "cls"}}
