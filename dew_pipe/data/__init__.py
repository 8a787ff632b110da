"""dew_pipe/data"""
