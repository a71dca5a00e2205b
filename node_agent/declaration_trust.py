"""Zero-trust start-up: with `--require-signed-config`, the agent loads its device declaration only
when `device-plugin-config.yaml.sig` is a valid signature of the file by a trusted key.

The bytes checked are the bytes parsed. An unsigned, changed or untrusted declaration stops the agent
before it registers, with a message naming the file.
"""

from __future__ import annotations

from pathlib import Path

from kunlun_common.errors import ConfigError
from kunlun_common.messages import msg, msg_list, of_error
from kunlun_common.modelpkg import SignatureError, TrustedKeys
from kunlun_common.modelpkg.detached import read_verified
from node_agent.plugins.config import NodeConfig, load_config, parse_config
from node_agent.settings import AgentSettings


def load_declaration(settings: AgentSettings) -> NodeConfig:
    if not settings.require_signed_config:
        return load_config(settings.config_path)
    if not settings.trusted_keys_dir:
        raise ConfigError(
            msg(
                "agent.flags.signed_needs_keys",
                "--require-signed-config needs --trusted-keys DIR (the signers' *.pub files)",
            )
        )
    trusted = TrustedKeys.load([], [Path(settings.trusted_keys_dir)])
    if not trusted.keys:
        raise ConfigError(
            msg(
                "agent.flags.no_trusted_keys",
                "--trusted-keys {dir}: no *.pub key there; add the signer's key",
                dir=settings.trusted_keys_dir,
            )
        )
    try:
        data, _ = read_verified(Path(settings.config_path), trusted)
    except SignatureError as e:
        raise ConfigError(
            msg_list(
                "agent.declaration.refused",
                "refusing the device declaration: {parts}",
                [of_error(e)],
                bullet="",
            )
        ) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(
            msg(
                "agent.declaration.not_utf8",
                "{path}: not UTF-8 text ({error})",
                path=settings.config_path,
                error=str(e),
            )
        ) from None
    return parse_config(text, settings.config_path)
