"""The packager: recipe -> passes -> signed artifact. Entry point: ``pipeline.build``."""
