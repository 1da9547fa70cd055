"""Packager passes; each module registers its passes with ``base.register``."""
