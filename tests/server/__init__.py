"""Tests of the OpenAI-compatible server (`verispec serve`)."""
