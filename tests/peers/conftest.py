"""Fixtures of the record-validator tests: two signing identities (module-scoped: RSA keys are slow to make)."""

from __future__ import annotations

import pytest

from tests.peers.test_validators import Signer, _signer


@pytest.fixture(scope="module")
def alice() -> Signer:
    return _signer()


@pytest.fixture(scope="module")
def mallory() -> Signer:
    return _signer()
