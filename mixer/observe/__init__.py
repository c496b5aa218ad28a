"""Counters turned into statistics, tables and plots."""
