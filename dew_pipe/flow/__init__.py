"""dew_pipe/flow"""
