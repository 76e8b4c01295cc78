"""What users look at: the report, block times, measured timelines, exports and the command line.
"""
