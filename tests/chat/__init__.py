"""Tests of the chat room: prefill cuts."""
