from __future__ import annotations

import pytest

from tests.serve.harness import text_model_folder


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory):
    return text_model_folder(tmp_path_factory.mktemp("text-model"))


@pytest.fixture(scope="session")
def bare_folder(tmp_path_factory):
    """The same kind of model without a chat template."""
    return text_model_folder(tmp_path_factory.mktemp("no-template"), chat_template=False)
