"""Streams on the device: pipeline documents (:mod:`.spec`, :mod:`.checks`), the tracker and the
rules that turn a stream's objects into events (:mod:`.tracker`, :mod:`.rules`)."""
