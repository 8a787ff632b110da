"""dew_pipe/objectives/rl"""
