"""Session-wide fixtures."""
import pytest

from tests.e2e_data import make_e2e_data


@pytest.fixture(scope="session")
def e2e_data(tmp_path_factory):
    """Preprocessed real text (see tests/e2e_data.py), shared by the end-to-end tests."""
    return make_e2e_data(tmp_path_factory.mktemp("e2e_data"))
