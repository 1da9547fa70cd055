"""``edgepack keygen``."""

from __future__ import annotations

from pathlib import Path

import click

from sdk.cli import main
from sdk.keys import write_keypair, write_operator_keypair


@main.command()
@click.option("--private", "private_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Where to write the PEM private key (mode 0600).")
@click.option("--public", "public_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Where to write the PEM public key, for devices' trust stores (or operator_keys).")
@click.option("--operator", is_flag=True,
              help="An operator key pair, for signing commands (deploy/device --operator-key), "
                   "not artifacts; devices list the public key under operator_keys in agent.yaml.")
@click.option("--force", is_flag=True, help="Overwrite existing key files.")
def keygen(private_path: Path, public_path: Path, operator: bool, force: bool) -> None:
    """Create an Ed25519 key pair: an artifact signing key, or with --operator a command signing key."""
    if operator:
        key_id = write_operator_keypair(private_path, public_path, force=force)
        click.echo(f"wrote operator key {private_path} (private, 0600) and {public_path} (public, for "
                   f"operator_keys in agent.yaml); key id {key_id}")
        return
    key_id = write_keypair(private_path, public_path, force=force)
    click.echo(f"wrote {private_path} (private, 0600) and {public_path} (public); key id {key_id}")
