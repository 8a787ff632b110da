"""dew_pipe/objectives"""
