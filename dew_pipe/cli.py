def main(): print("cli")
