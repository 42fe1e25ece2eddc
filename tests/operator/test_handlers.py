"""grpo_operator.cluster.handlers: kopf's settings (our prefixes, short timeouts)."""

from __future__ import annotations

import kopf

from grpo_operator.api import FINALIZER
from grpo_operator.cluster.handlers import configure_settings


def test_kopf_settings_use_our_prefixes_and_short_timeouts():
    settings = kopf.OperatorSettings()
    configure_settings(settings)
    assert settings.persistence.finalizer == FINALIZER == "grpo.dev/finalizer"
    assert settings.networking.request_timeout == 30
    assert settings.watching.inactivity_timeout > settings.watching.server_timeout
    assert settings.posting.loggers is False
