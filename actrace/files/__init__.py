"""Trace files on disk: writing them (`writer`, `table`), reading and scanning them (`reader`),
checking them against the spec (`validate`, `describe`), and writing outputs safely (`output`)."""
