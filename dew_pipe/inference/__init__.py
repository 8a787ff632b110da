"""dew_pipe/inference"""
