"""Operator performance models: how long an operator takes at shapes never traced."""
