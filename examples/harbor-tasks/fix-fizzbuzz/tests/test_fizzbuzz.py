from fizzbuzz import fizzbuzz


def test_plain():
    assert [fizzbuzz(n) for n in (1, 2, 4)] == ["1", "2", "4"]


def test_fizz_and_buzz():
    assert fizzbuzz(9) == "Fizz"
    assert fizzbuzz(10) == "Buzz"


def test_fizzbuzz():
    assert fizzbuzz(15) == "FizzBuzz"
    assert fizzbuzz(45) == "FizzBuzz"
