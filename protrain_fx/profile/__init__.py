"""Measurements of the machine (copy bandwidth, optimizer step rates, op times), cached per device.
"""
