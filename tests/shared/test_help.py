"""``--help`` of every command shows each option's default: ``baton`` and every one of its
subcommands, and each service's ``python -m services.<role> --help`` (its variables)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
from pydantic_settings import BaseSettings

from services.decode.settings import DecodeSettings
from services.gateway.settings import GatewaySettings
from services.kvstore.settings import KVStoreSettings
from services.mixed.settings import MixedSettings
from services.prefill.settings import PrefillSettings
from shared.cli import build_parser, parsers
from shared.config import BatonSettings
from shared.service import PROCESS_ENV


def test_every_option_of_every_command_shows_its_default() -> None:
    commands, missing = [], []
    for prog, parser in parsers(build_parser()):
        commands.append(prog)
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            name = f"{prog} {'/'.join(action.option_strings)}"
            assert action.help, f"{name} has no help"
            if action.nargs == 0 or action.required:
                continue  # a flag (off unless given), or nothing to default to
            if "default" not in formatter._expand_help(action):
                missing.append(name)
    assert commands == ["baton", "baton model", "baton model list", "baton model pull",
                        "baton generate",
                        "baton up", "baton status", "baton secret", "baton bench",
                        "baton profile", "baton plan"]  # fmt: skip
    assert not missing, f"options whose --help shows no default: {missing}"


def run_help(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    proc = subprocess.run(
        [sys.executable, *args, "--help"], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return " ".join(proc.stdout.split())  # unwrapped


def test_baton_up_help_takes_its_defaults_from_the_settings_tree() -> None:
    text = run_help("-m", "shared.cli", "up")
    assert "gateway port (default: 8000)" in text
    kv_cache_gb = BatonSettings.model_fields["kv_cache_gb"].default
    assert f"(default: $BATON_KV_CACHE_GB, else {kv_cache_gb})" in text
    assert "--transport {ucx,tcp} KV data plane (default: ucx)" in text


@pytest.mark.parametrize(
    ("role", "settings"),
    [
        ("kvstore", KVStoreSettings),
        ("prefill", PrefillSettings),
        ("decode", DecodeSettings),
        ("mixed", MixedSettings),
        ("gateway", GatewaySettings),
    ],
)
def test_service_help_lists_every_variable_with_its_default(
    role: str, settings: type[BaseSettings]
) -> None:
    lines = run_help("-m", f"services.{role}").replace(" BATON_", "\nBATON_").splitlines()
    shown = {line.split()[0]: line for line in lines if line.startswith("BATON_")}
    prefix = str(settings.model_config["env_prefix"])
    expected = [f"{prefix}{name}".upper() for name in settings.model_fields]
    expected += [f"BATON_{name}".upper() for name in BatonSettings.model_fields]
    assert sorted(shown) == sorted([*expected, *PROCESS_ENV])
    assert all("(default: " in line for line in shown.values())
    port = settings.model_fields["http_port" if role == "kvstore" else "port"].default
    assert f"(default: {port})" in shown[f"{prefix}{'HTTP_PORT' if role == 'kvstore' else 'PORT'}"]


def test_a_service_refuses_arguments() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.kvstore", "--port", "1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("baton kvstore: error: takes no arguments")
