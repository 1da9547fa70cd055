"""The packager's typed pass options: the shared implementation is
:mod:`edgepack_core.typed_options` (the device's pipeline documents use it too); this module
keeps the packager's import path."""

from __future__ import annotations

from edgepack_core.typed_options import field_schema, given, option, parse, parse_fields, schema_of

__all__ = ["field_schema", "given", "option", "parse", "parse_fields", "schema_of"]
