"""dew_pipe/beam"""
