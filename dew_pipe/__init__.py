"""dew_pipe"""
