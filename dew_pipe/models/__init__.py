"""dew_pipe/models"""
