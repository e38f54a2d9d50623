"""Collapse detection (`detector`) and the actions taken on it (`actions`): pure code
over plain data, no torch."""
